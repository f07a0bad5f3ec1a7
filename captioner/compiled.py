"""PyTorch's compiler for the two fixed-shape loops: the training step's forward and backward and the
search's block of steps. On a GPU, `torch.compile(mode="reduce-overhead")` also replays them as CUDA
graphs; elsewhere the default mode fuses their kernels.

`Compiled` runs a function through the compiler, whole, with the guards every caller would otherwise repeat:
- an error of the compiler's own (a compile that fails, a graph break, more recompiles than its limit):
  one warning naming the function and the reason, and the function runs eagerly from then on. The backward
  compiles with its forward, so every compile is over before anything of a call runs. Any other error (out of
  memory, also while Inductor benchmarks; a bad input; a kernel or a CUDA graph's capture failing at a first
  run) is the caller's, raised as it is, never retried eagerly on top of what ran, and the function stays compiled;
- on a GPU, a function that compiled but runs without CUDA graphs is said in the same way;
- each call that compiled is logged with its time, and the threads that compiled are kept: CUDA graph
  trees are per thread, so a server compiles on the thread that serves.
`TORCH_LOGS=recompiles` says why a function recompiled.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the command line reads this module's constants
    import torch

log = logging.getLogger(__name__)

FELL_BACK = "a compiled function fell back"  # how every fallback's warning begins (`captioner selfcheck` looks for it)
GRAPHS = "reduce-overhead"  # the mode whose code a GPU replays as CUDA graphs
# Searches from which compiling the search's block saves a GPU more than the compile costs (docs/training.md).
EARNS_BACK = 3000


def first_line(error: BaseException) -> str:
    """An exception as one line: the compiler's errors go on for many with advice on debugging. A line that
    ends in a colon ("backend='inductor' raised:") is followed by the one that says what."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    said = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return f"{type(error).__name__}: {said}"


def earns_back(searches: int) -> bool:
    return searches >= EARNS_BACK


def search_compiles(device: torch.device, graphs: bool) -> bool:
    """Whether a model on `device` compiles its search when asked to (`Captioner.compile_search`)."""
    return graphs and device.type == "cuda"


def compile_mode(device: torch.device, *, graphs: bool) -> str:
    """The compiler's mode for work on `device`: CUDA graphs on a GPU where `graphs` allows them."""
    return GRAPHS if graphs and device.type == "cuda" else "default"


class Compiled:
    """`fn` through `torch.compile`, falling back to eager calls of `fn` (module doc). `compiled` runs in
    `fn`'s place for work compiled in parts (a compiled forward and its AOTAutograd backward); `limit` is
    the most compiles, the first included, before the next one is a failure."""

    def __init__(
        self,
        fn: Callable,
        what: str,
        *,
        mode: str,
        compiled: Callable | None = None,
        dynamic: bool | None = False,
        limit: int = 8,
    ):
        import torch

        self.fn, self.what, self.mode, self.limit = fn, what, mode, limit
        self.compiled = compiled or torch.compile(fn, mode=mode, fullgraph=True, dynamic=dynamic)
        self.failed: str | None = None  # why it runs eagerly, once it does
        self.graphless = False  # said once: on a GPU, it runs without CUDA graphs
        self.seconds = 0.0  # spent in calls that compiled
        self.threads: set[int] = set()  # the threads (`threading.get_ident`) on which it compiled

    def __call__(self, *args):
        if self.failed is not None:
            return self.fn(*args)
        # The compiler's, imported where it runs: importing it takes over a second.
        from torch._dynamo import config, exc
        from torch._dynamo.utils import counters
        from torch._functorch import config as aot_config

        graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        began = time.monotonic()
        try:
            # The backward compiles with its forward, not at the first `.backward()`: a failure then comes
            # before the forward ran, not after it ran (drawing, writing its terms' state, under DDP firing
            # gradient hooks) with an eager step taken on top.
            with (
                config.patch(recompile_limit=self.limit, fail_on_recompile_limit_hit=True),
                aot_config.patch(force_non_lazy_backward_lowering=True),
            ):
                out = self.compiled(*args)
        except (exc.TorchDynamoException, exc.FailOnRecompileLimitHit) as e:
            if oom := _out_of_memory(e):
                raise oom from None  # Inductor runs kernels on real tensors while it compiles
            out = self.fn(*args)  # an input that fails while traced raises here, as it does eagerly
            self.fall_back(first_line(e))
            return out
        if counters["stats"]["unique_graphs"] > graphs:
            seconds = time.monotonic() - began
            self.seconds += seconds
            self.threads.add(threading.get_ident())
            log.info(f"compiled {self.what} ({self.mode}) in {seconds:.1f} s")
        if self.mode == GRAPHS and counters["inductor"]["cudagraph_skips"] > skips and not self.graphless:
            self.graphless = True
            log.warning(f"{FELL_BACK}: {self.what} runs compiled but without CUDA graphs (`TORCH_LOGS=cudagraphs`)")
        return out

    def fall_back(self, reason: str) -> None:
        self.failed = reason
        log.warning(f"{FELL_BACK}: {self.what} did not compile ({reason}); it runs eagerly from here")


def _out_of_memory(error: BaseException) -> BaseException | None:
    """The out-of-memory error a compiler error was raised from, if it was."""
    import torch

    while error is not None and not isinstance(error, torch.OutOfMemoryError):
        error = getattr(error, "inner_exception", None) or error.__cause__
    return error


def no_autocast(device: torch.device):
    """Leave a caller's autocast region: the search runs in the model's own precision."""
    import torch

    return torch.autocast(device.type, enabled=False) if device.type in ("cuda", "cpu") else contextlib.nullcontext()
