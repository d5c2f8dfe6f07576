"""Where a peer's swarm secret comes from: a file (created by `diloco start`) or an environment variable.

The secret never appears on a command line (shell history, `ps`), in logs or in metrics: `start`
writes it to a file readable only by its owner and prints the file's path; other machines get a
copy of that file (scp) or the value in `DILOCO_SECRET`.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from diloco.comms.auth import check_secret, new_secret
from diloco.compression.errors import DiLoCoError

log = logging.getLogger(__name__)

ENV = "DILOCO_SECRET"


class CredentialError(DiLoCoError, ValueError):
    """No usable secret; the message says where one was looked for and how to provide it."""


def default_file(run_id: str) -> Path:
    return Path(f"diloco-{run_id}.secret")


def read_secret(path: Path) -> str:
    """The secret in `path`; warns when others may read the file."""
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as e:
        raise CredentialError(f"cannot read the secret file {path}: {e.strerror}; copy the file `diloco start` "
                              "wrote on the first machine, or set DILOCO_SECRET") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("event=secret_file_readable path=%s fix=chmod 600 %s", path, path)
    try:
        check_secret(text)
    except ValueError as e:
        raise CredentialError(f"{path}: {e}") from None
    return text


def create_secret(path: Path) -> str:
    """A new secret written to `path` (owner read/write only); refuses to overwrite a file."""
    secret = new_secret()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CredentialError(f"{path} exists already; pass it with --secret-file to reuse it") from None
    except OSError as e:
        raise CredentialError(f"cannot create the secret file {path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def resolve(path: str | os.PathLike[str] | None, *, run_id: str, create: bool) -> tuple[str, str]:
    """(secret, where it came from, for humans). Order: `path`, then $DILOCO_SECRET, then (when `create`,
    i.e. `diloco start`) the default file diloco-<run id>.secret in the working directory, made if missing."""
    if path is not None:
        path = Path(path)
        if create and not path.exists():
            return create_secret(path), f"created {path}"
        return read_secret(path), str(path)
    value = os.environ.get(ENV)
    if value is not None:
        try:
            check_secret(value)
        except ValueError as e:
            raise CredentialError(f"${ENV}: {e}") from None
        return value.strip(), f"${ENV}"
    if not create:
        raise CredentialError("this swarm needs its secret: pass --secret-file PATH (a copy of the file `diloco "
                              f"start` wrote, e.g. {default_file(run_id)}) or set {ENV}")
    target = default_file(run_id)
    if target.exists():
        return read_secret(target), str(target)
    return create_secret(target), f"created {target}"
