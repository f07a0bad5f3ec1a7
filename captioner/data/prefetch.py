"""Batches made ahead on a thread of their own, so that the step does not wait for them."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator

_DONE = object()


def prefetched(items: Iterable, depth: int = 2) -> Iterator:
    """`items` in their order, made up to `depth` ahead on a background thread; an exception raised while
    making one is raised here, where that item would have come. Closing the iterator early (a stop, the
    time budget) stops the thread after the item it is making."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            put((_DONE, e))
            return
        put((_DONE, None))

    thread = threading.Thread(target=make, name="captioner-batches", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
