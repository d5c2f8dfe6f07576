"""An asyncio event loop on a background thread, for synchronous callers (the training loop).

hivemind's P2P and DHT are asyncio objects that must live on one loop; the user's training loop
is synchronous. `LoopThread.run(coro, timeout)` submits a coroutine and waits for it, so the
training thread blocks only as long as the round protocol's own deadlines allow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "diloco-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:  # stopped (`stop`): release the loop's selector and its self-pipe, as `asyncio.run` does
            try:
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            except Exception:  # noqa: BLE001 - closing must never fail
                pass
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout}s") from None
        except BaseException:  # e.g. Ctrl-C while we waited: nobody will read the result, so stop the work too
            future.cancel()
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, grace: float = 2.0) -> None:
        """Cancel every task still on the loop (a heartbeat between beats, a refusal the tarpit holds),
        let them unwind for up to `grace` seconds, then stop the loop, as `asyncio.run` does on exit: a
        task left pending would be reported as destroyed when the interpreter collects it."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.stop() called from its own loop; call it from another thread")
        if self.loop.is_running():
            try:
                self.run(_cancel_all(grace), timeout=grace + 1)
            except Exception:  # noqa: BLE001 - stopping must never fail
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


async def _cancel_all(grace: float) -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    if tasks:
        done, _ = await asyncio.wait(tasks, timeout=grace)
        for t in done:  # retrieved, so none is reported as "never retrieved" at exit
            if not t.cancelled():
                t.exception()
