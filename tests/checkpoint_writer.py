"""Writer process for test_checkpoint's kill -9 test (run as `python -I checkpoint_writer.py MODULE ROOT
START`). It loads diloco/checkpoint.py straight from its file (no torch: safetensors and numpy come from
site-packages), prints "ready", then saves checkpoints START, START+1, ... until it is killed, printing
"saved STEP" after each save returns. Every tensor is a function of its step (`tensors`), so the parent
can verify any checkpoint it loads."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

PAYLOAD_BYTES = 2 << 20   # 2 MiB per checkpoint: a save takes ~10 ms on the CI box


def load_module(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("diloco_checkpoint_standalone", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod   # dataclasses looks its module up in sys.modules
    spec.loader.exec_module(mod)
    return mod


def payload(step: int) -> bytes:
    return hashlib.shake_256(b"step=%d" % step).digest(1 << 16) * (PAYLOAD_BYTES >> 16)


def tensors(step: int) -> dict[str, Any]:
    return {"w": np.frombuffer(payload(step), dtype="<f4").reshape(PAYLOAD_BYTES // 4096, 1024),
            "b": np.array([step, 2 * step, -step], dtype=np.int64)}


def meta(step: int) -> dict[str, Any]:
    return {"step": step, "sha256": hashlib.sha256(payload(step)).hexdigest()}


def main() -> None:
    module_path, root, start = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    ck = load_module(module_path)
    print("ready", "torch" in sys.modules, flush=True)
    step = start
    while True:
        ck.save(root, step, tensors(step), meta(step), keep=3)
        print(f"saved {step}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
