"""A CUDA graph capture that fails inside CUDA, for the GPU checks (benchmarks/gpu_checks.py): with
CAPTIONER_BREAK_CAPTURE=1 and this folder first on PYTHONPATH, every capture's function ends with a
host read (`.item()`), which CUDA refuses while the stream is capturing, after `capture_begin`."""

import os

if os.environ.get("CAPTIONER_BREAK_CAPTURE"):
    import torch

    from captioner import cuda_graphs

    _capture = cuda_graphs.GraphCapture.capture

    def _broken_capture(self, fn, generators=(), **kwargs):
        def broken():
            fn()
            torch.zeros((), device=self.device).item()  # a host read while capturing: CUDA refuses it

        return _capture(self, broken, generators, **kwargs)

    cuda_graphs.GraphCapture.capture = _broken_capture
