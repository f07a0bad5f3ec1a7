"""A compiler that refuses every function, for the GPU checks (benchmarks/gpu_checks.py): with
CAPTIONER_BREAK_COMPILE=1 and this folder first on PYTHONPATH, every function `torch.compile` is given breaks
its graph where it must compile whole, a real error of the compiler's own at its first call;
`captioner.compiled` then goes on eagerly with one warning per function."""

import os

if os.environ.get("CAPTIONER_BREAK_COMPILE"):
    import torch

    _compile = torch.compile

    def _refused(fn=None, **kwargs):
        def breaking(*args, **kw):
            torch._dynamo.graph_break()
            return fn(*args, **kw)

        return _compile(breaking, **{**kwargs, "fullgraph": True})

    torch.compile = _refused
