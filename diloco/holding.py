"""`Holding`: the global state one worker holds, and what derives from it.

The state is θ (fp32 copies of the trained parameters), the outer optimizer over θ and the round
(`diloco.state.GlobalState`). Derived from it: the manifest (SHA-256 of every 4 MiB chunk) and the digest
the swarm compares, and the digests of the last rounds held (`recent`, published with the peer's record).

Three threads touch the state. The training thread changes it (an outer step, a download); the event-loop
thread serializes it for a peer catching up, and `lock` keeps it from seeing half of a change. The manifest
is hashed on a thread of its own, beside the next inner steps (hashing 85M parameters and their momentum
takes longer than the outer step itself): `digest` and `manifest` wait for it, which the next round does,
H inner steps later, long after it is done; `known()` answers at once ("" while the hash is under way),
which is what a record published right after a commit carries until `on_known` listeners publish the
digest. The hash reads the state in place, so a change waits for the hash in flight before it starts (no
second copy of the state is kept for it); so does other work that reads it in place beside training (`beside`:
a periodic checkpoint). A change of one fragment's parameters hashes again only the chunks that hold them
(`changing(touched=...)`). An FSDP2 site hashes its state from every rank's pieces, a collective call that all
ranks make together: there the hash stays on the training thread.
Whatever must follow a change (the snapshot server dropping idle copies) registers with `on_change`.
"""

from __future__ import annotations

import collections
import copy
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Sequence

import torch

from .outer import OuterFactory, is_pinned
from .state import GlobalState, Manifest


class Later:
    """A value (the digest of one state) that a thread of ours is still computing: `ready()` without waiting,
    `get()` waiting for it, `then(fn)` calling `fn()` once it is there (at once if it is)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value = ""
        self._then: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def ready(self) -> bool:
        return self._done.is_set()

    def get(self) -> str:
        self._done.wait()
        return self._value

    def then(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._then.append(fn)
                return
        fn()

    def set(self, value: str) -> None:
        with self._lock:
            self._value = value
            self._done.set()
            waiting, self._then = self._then, []
        for fn in waiting:
            fn()


RECENT = 4
"""How many (round, digest) pairs of the states we held our record publishes."""


class Holding:
    """One worker's global state, its digest, and the lock around changes to it."""

    def __init__(self, state: GlobalState, outer_factory: OuterFactory, device: torch.device,
                 manifest_of: Callable[[GlobalState], Manifest] | None = None, *,
                 background: bool | None = None) -> None:
        """`device`: where θ and the outer state live (`DiLoCo(global_device=...)`). `manifest_of`: how the state
        is hashed (default `GlobalState.manifest`; an FSDP2 site hashes the whole state from its ranks' pieces,
        `SiteShards.manifest`). `background`: hash on a thread of our own (default: unless `manifest_of` is
        given, which may be a collective call every rank makes on its training thread)."""
        self.state = state
        self.outer_factory = outer_factory
        self.device = device
        self.lock = threading.Lock()
        """Held by the training thread while it changes the state, and by the event-loop thread while it
        serializes the state for a peer catching up."""
        self.recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=RECENT)
        """The last (round, digest) states we held, published with our record (`PeerRecord.recent`)."""
        self._manifest_of = manifest_of or GlobalState.manifest
        self._background = manifest_of is None if background is None else background
        self._listeners: list[Callable[[], None]] = []
        self._known_listeners: list[Callable[[], None]] = []
        self._settled = threading.Condition()
        """Guards `_manifest`, `_failed` and `recent`, and wakes whoever waits for the hash."""
        self._manifest: Manifest | None = None
        self._failed: BaseException | None = None
        self.changes = 0
        """How many times the state changed: whether some work changed it (`SiteLink.settle`)."""
        self._hasher: threading.Thread | None = None
        self._readers: list[threading.Thread] = []
        """Other work that reads the state in place beside training (`beside`: a periodic checkpoint)."""
        self.waited = 0.0
        """Seconds the training thread waited for that work and the hash before changing the state (a round shorter
        than the hash of the one before waits for it)."""
        self._side_stream: torch.cuda.Stream | None = None
        """Where that work's copies of a state on a GPU run (`_off_the_stream`)."""
        self._later: Later
        with self.lock:
            self.changed()

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def params(self) -> list[torch.Tensor]:
        """θ."""
        return self.state.params

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every change of the state (on the training thread, with `lock` held)."""
        self._listeners.append(listener)

    def on_known(self, listener: Callable[[], None]) -> None:
        """Call `listener()` once the digest of a changed state is known, when it was not at the change (on the
        hashing thread, without `lock`: a listener must not wait for a change of the state)."""
        self._known_listeners.append(listener)

    @property
    def manifest(self) -> Manifest:
        """The manifest of the state we hold, waiting for its hash if it is under way."""
        with self._settled:
            while self._manifest is None:
                if self._failed is not None:
                    raise self._failed
                self._settled.wait()
            return self._manifest

    @property
    def digest(self) -> str:
        """The digest of the state we hold, waiting for its hash if it is under way."""
        return self.manifest.digest

    def known(self) -> str:
        """The digest of the state we hold, or "" while it is being hashed (never waits)."""
        with self._settled:
            return self._manifest.digest if self._manifest is not None else ""

    def later(self) -> Later:
        """The digest of the state we hold now, to be read once it is hashed (a metrics line written beside
        training: `diloco.metrics`)."""
        with self._settled:
            return self._later

    def record(self) -> tuple[int, str, tuple[tuple[int, str], ...]]:
        """What our record says of our state, read at one moment: the round, its digest ("" while being hashed)
        and the (round, digest) of the last states we held."""
        with self._settled:
            return self.state.round, self._manifest.digest if self._manifest is not None else "", tuple(self.recent)

    def changed(self, touched: Collection[int] | None = None) -> None:
        """The state changed (call with `lock` held; `touched`: the only parameters whose θ and outer state
        changed, when the change was one fragment's, else all may have): hash it (beside training, or here), then
        the new manifest and digest hold, and `recent` one state per round (a state replaced at its round is not
        ours any more)."""
        self.changes += 1
        with self._settled:
            previous = self._manifest if touched is not None and self._incremental() else None
            self._manifest, self._failed, self._later = None, None, Later()
        for listener in self._listeners:
            listener()
        state = self.state
        if not self._background:
            self._hashed(state, self._hash_of(state, previous, touched))
            return
        self._hasher = threading.Thread(target=self._off_the_stream(self._hash), args=(state, previous, touched),
                                        name="diloco-digest")
        self._hasher.start()

    def _off_the_stream(self, work: Callable[..., None]) -> Callable[..., None]:
        """`work` (reading the state beside training) as a thread runs it: for a state on a GPU, its copies to the
        host go on a stream of their own, after the work the training thread has queued so far (the change they
        read), instead of between the training's kernels on the stream they share; call from the training thread."""
        if self.device.type != "cuda":
            return work
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def run(*args: Any) -> None:
            with torch.cuda.stream(stream):
                work(*args)
        return run

    def _incremental(self) -> bool:
        """Whether a change of some parameters leaves the others' bytes alone: our own hashing, and an outer
        optimizer of torch's, which steps only the parameters given a gradient (a user's own might not)."""
        return self._manifest_of is GlobalState.manifest and type(self.state.outer).__module__.startswith("torch.optim")

    def _hash_of(self, state: GlobalState, previous: Manifest | None, touched: Collection[int] | None) -> Manifest:
        """`state`'s manifest: only the chunks `touched` changed are hashed again when `previous` is the manifest of
        the state before (`GlobalState.manifest`). Beside training it hashes on one core in two (the others are
        training's)."""
        if self._manifest_of is GlobalState.manifest:
            workers = max(1, (os.cpu_count() or 2) // 2) if self._background else None
            return state.manifest(previous=previous, touched=touched, workers=workers)
        return self._manifest_of(state)

    def _hash(self, state: GlobalState, previous: Manifest | None, touched: Collection[int] | None) -> None:
        try:
            manifest = self._hash_of(state, previous, touched)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the digest
            with self._settled:
                self._failed = e
                self._settled.notify_all()
                later = self._later
            later.set("")  # a metrics line waiting for it says "" rather than never being written
            raise
        self._hashed(state, manifest)
        for listener in self._known_listeners:
            listener()

    def _hashed(self, state: GlobalState, manifest: Manifest) -> None:
        with self._settled:
            self._manifest = manifest
            while self.recent and self.recent[-1][0] >= state.round:
                self.recent.pop()
            self.recent.append((state.round, manifest.digest))
            self._settled.notify_all()
            later = self._later
        later.set(manifest.digest)

    def beside(self, work: Callable[[], None], name: str) -> None:
        """Run `work` on a thread of its own, reading the state in place (a checkpoint written beside training): the
        next change of the state waits for it, as for the hash (call from the training thread)."""
        self._readers = [t for t in self._readers if t.is_alive()]
        reader = threading.Thread(target=self._off_the_stream(work), name=name)
        self._readers.append(reader)
        reader.start()

    def settle(self) -> None:
        """Wait for the hash and the other work in flight that read the state in place (call before changing it,
        from the training thread)."""
        hasher, self._hasher = self._hasher, None
        readers, self._readers = self._readers, []
        busy = [t for t in (hasher, *readers) if t is not None and t is not threading.current_thread() and t.is_alive()]
        if busy:
            started = time.perf_counter()
            for t in busy:
                t.join()
            self.waited += time.perf_counter() - started

    @contextmanager
    def changing(self, touched: Collection[int] | None = None) -> Iterator[GlobalState]:
        """`with holding.changing() as state:` change `state` in place; the digest follows on leaving. `touched`:
        the parameters whose θ and outer state the change may write, when not all (one fragment's outer step): the
        others' chunks of the manifest are not hashed again."""
        with self.lock:
            self.settle()
            yield self.state
            self.changed(touched)

    def replace(self, fresh: GlobalState) -> None:
        """Hold `fresh` from now on (downloaded, resumed, handed out by a site's leader)."""
        with self.lock:
            self.settle()
            self.state = fresh
            self.changed()

    def empty_like(self) -> GlobalState:
        """A new state shaped like ours, on the same device (to load bytes into)."""
        return GlobalState(self.state.params, self.outer_factory, self.device)

    def clone(self) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        """A private copy of θ and the outer optimizer (the eager overlapped step, which must not touch θ)."""
        params = [torch.empty_like(p, pin_memory=is_pinned(p)).copy_(p) for p in self.state.params]
        outer = self.outer_factory(params)
        outer.load_state_dict(copy.deepcopy(self.state.outer.state_dict()))
        return params, outer


def views(tensors: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of one fragment (its parameter indices), in order."""
    return [tensors[i] for i in indices]
