"""Capturing CUDA graphs as PyTorch's CUDA notes document it, in one place: the training step
(`train.step`) and the fixed-shape search (`decoding.graphed_search`) both capture through it.

The rules it keeps, each of which the callers would otherwise have to remember:
- warm-up and capture run on one side stream of the tensors' own device (not the current one);
- the capture mode is thread-local, so another thread (a loader pinning memory) may use CUDA
  while a graph is being captured;
- no autocast cache is live during a capture: a captured region that enters autocast itself
  must pass `cache_enabled=False` (`autocast`), and code captured from inside a caller's autocast
  region turns it off (`no_autocast`);
- every graph of the process on one device (the training step's and the searches') shares one memory
  pool and one side stream. Replaying them in any order is safe because each reads across replays
  only tensors allocated outside the pool (weights, optimizer state, static inputs); what a graph
  allocates while captured is written before it is read;
- random generators other than the default are registered with the graph where this torch needs
  it (newer versions register them on first use);
- a capture that fails after CUDA began it (`CaptureBroken`) ends the work of the process: CUDA's
  allocator can be left with a capture underway (every later `empty_cache` then asserts) and, on
  some torch versions, the default generator in capture mode (the next eager dropout raises), as
  PyTorch's own `CUDAGraph::reset` warns. A failure before that (a refusal in Python, a failed
  `capture_begin`) leaves nothing behind, and the caller may go on without the graph.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator

import torch

from captioner.errors import CaptionerError

log = logging.getLogger(__name__)


FELL_BACK = "a CUDA graph fell back"  # how every fallback's warning begins (`captioner selfcheck` looks for it)
STOPS = (
    "CUDA may be left mid-capture, so this process stops; run again without graphs (`--cuda-graphs off` for fit "
    "and evaluate, `--no-graphs` for captioner caption and demo, `graphs=False` for Captioner.load)"
)


def first_line(error: BaseException) -> str:
    """An exception as one line: CUDA's errors go on for several with advice on debugging."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


class CaptureBroken(CaptionerError):
    """A graph's capture failed after CUDA began it: the process must not go on with CUDA work (module doc)."""


_SHARED: dict[torch.device, dict] = {}  # device → the process's graph pool and side stream there


class GraphCapture:
    """Captures CUDA graphs on one device, in the memory pool and on the side stream that every graph
    of the process shares there.

    Args:
        device: where the captured work runs (cuda means the current device; cuda:N names it).
    """

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._shared = _SHARED.setdefault(device, {"pool": None, "stream": None})

    @staticmethod
    def supported(device: torch.device) -> bool:
        """Whether graphs can be captured for work on `device`."""
        return device.type == "cuda" and torch.cuda.is_available()

    @property
    def pool(self):
        return self._shared["pool"]

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._shared["stream"] is None:
            self._shared["stream"] = torch.cuda.Stream(self.device)
        return self._shared["stream"]

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the enclosed work (a warm-up before a capture) on the side stream, ordered after what the
        current stream has queued and before what it queues next."""
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                yield
            current.wait_stream(self.stream)

    def capture(
        self, fn: Callable[[], None], generators: tuple[torch.Generator, ...] = (), *, what: str = "a CUDA graph"
    ) -> torch.cuda.CUDAGraph:
        """`fn`'s kernels as a graph to replay (nothing runs now).

        Args:
            generators: the random generators `fn` draws from besides the device's default.
            what: the graph, as a message names it.

        Raises:
            CaptureBroken: the capture failed once CUDA had begun it. Any other exception: it failed
                before, leaving nothing behind.
        """
        with torch.cuda.device(self.device):
            graph = torch.cuda.CUDAGraph()
            register = getattr(graph, "register_generator_state", None)
            with warnings.catch_warnings():  # deprecated where torch registers generators itself
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                for g in generators if register else ():
                    register(g)
            if self.pool is None:
                self._shared["pool"] = torch.cuda.graph_pool_handle()
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            began = False
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    began = True  # capture_begin returned: from here a failure leaves CUDA mid-capture
                    fn()
            except Exception as e:
                if began:
                    failed = f"the capture of {what} failed inside CUDA ({first_line(e)})"
                    raise CaptureBroken(f"{failed}; {STOPS}") from e
                raise
            current.wait_stream(self.stream)
        return graph


def autocast(device: torch.device, dtype: torch.dtype | None, *, graphed: bool):
    """Autocast to `dtype` (None: none) for a region that may be captured: without the weight-cast cache
    when it is (`graphed`), since the cache would be freed while the graph still reads it."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=not graphed)


def no_autocast(device: torch.device):
    """Leave a caller's autocast region: work captured from inside it runs in its own precision."""
    return torch.autocast(device.type, enabled=False) if device.type in ("cuda", "cpu") else contextlib.nullcontext()
