"""Concurrent caption requests batched into shared forward passes, on one thread that owns the model."""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from PIL import Image

from captioner.decoding.settings import Decoding
from captioner.serve.api import Caption, Captioner


class Batcher:
    """Requests that wait while a batch runs form the next batch (up to `max_batch_size`, grouped by their
    decoding settings). If a batch fails, its images are retried one at a time, so an error reaches only the
    request that caused it. On a GPU the thread first compiles the searches of the `warm` settings for every
    batch size (PyTorch keeps CUDA graphs per thread); `ready` says when it serves."""

    def __init__(self, captioner: Captioner, *, max_batch_size: int = 8, warm: Sequence[Decoding] = ()):
        self.captioner, self.max_batch_size = captioner, max_batch_size
        self._queue: queue.Queue[tuple | None] = queue.Queue()  # (image, Decoding, Future)
        self.ready: Future[float] = Future()  # the seconds spent compiling, once the thread serves
        self.thread = threading.Thread(target=self._serve, args=(tuple(warm),), name="captioner-batcher", daemon=True)
        self.thread.start()

    def caption(self, image: Image.Image, decoding: Decoding | None = None) -> Caption:
        """Caption one decoded image, sharing a forward pass with concurrent callers."""
        done: Future[Caption] = Future()
        self._queue.put((image, decoding or Decoding(), done))
        return done.result()

    def close(self) -> None:
        """Stop the worker after the requests already queued."""
        self._queue.put(None)
        self.thread.join()

    def _serve(self, warm: tuple[Decoding, ...]) -> None:
        try:
            sizes = range(1, self.max_batch_size + 1)
            self.ready.set_result(self.captioner.compile_search(sizes, warm) if warm else 0.0)
        except Exception as e:  # the server says so (`ready`); requests are still answered, eagerly
            self.ready.set_exception(e)
        self._loop()

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:  # close() was called: finish this batch, then stop
                    self._queue.put(None)
                    break
                batch.append(nxt)
            groups = collections.defaultdict(list)  # caption_batch takes one set of settings
            for image, decoding, done in batch:
                groups[decoding].append((image, done))
            for decoding, group in groups.items():
                self._run(group, decoding)

    def _run(self, group: list[tuple[Image.Image, Future]], decoding: Decoding) -> None:
        try:
            outs = self.captioner.caption_batch([im for im, _ in group], decoding=decoding)
        except Exception as e:
            if len(group) == 1:
                group[0][1].set_exception(e)
            else:  # find the culprit: retry alone, so the others still get their captions
                for item in group:
                    self._run([item], decoding)
            return
        for (_, done), out in zip(group, outs):
            done.set_result(out)
