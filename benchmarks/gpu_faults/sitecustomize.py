"""A compiler that fails, for the GPU checks (benchmarks/gpu_checks.py): with CAPTIONER_BREAK_COMPILE=1 and
this folder first on PYTHONPATH, every function `torch.compile` returns raises at its first call, as an
Inductor error would; `captioner.compiled` then goes on eagerly with one warning per function."""

import os

if os.environ.get("CAPTIONER_BREAK_COMPILE"):
    import torch

    def _broken_compile(fn=None, **kwargs):
        def broken(*args, **kw):
            raise RuntimeError("injected compile failure (benchmarks/gpu_faults)")

        return broken

    torch.compile = _broken_compile
