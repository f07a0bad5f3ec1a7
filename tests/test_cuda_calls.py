"""Every stream, event and `torch.cuda` call in the package names its device or stream.

Without one, CUDA takes the *current* device, which a single process never sets: work on cuda:1
would be recorded, synchronized or seeded on cuda:0's, and nothing would say so (an event recorded
on the wrong stream is already complete, so a copy from cuda:1 is read before it lands).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "captioner"

# torch.cuda functions that act on the current device unless given one.
NEED_DEVICE = {
    "synchronize", "current_stream", "default_stream", "Stream", "get_rng_state", "set_rng_state",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "memory_stats", "mem_get_info",
}  # fmt: skip
# torch.cuda functions with no device argument at all, that act on the current device.
NEVER = {"manual_seed", "seed", "initial_seed"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def unnamed_device_calls(source: str, name: str = "<source>") -> list[str]:
    """`file:line call` for each torch.cuda call, or event `.record()`, that leaves the device or stream to CUDA."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        called = _dotted(node.func)
        fn = called.rsplit(".", 1)[-1]
        named = bool(node.args or node.keywords)
        cuda = called.startswith("torch.cuda.")
        if (cuda and fn in NEED_DEVICE and not named) or (cuda and fn in NEVER) or (fn == "record" and not named):
            found.append(f"{name}:{node.lineno} {called}()")
    return found


def test_the_rule_sees_an_event_recorded_on_the_current_stream():
    bad = "done = torch.cuda.Event()\ndone.record()\ntorch.cuda.synchronize()\ntorch.cuda.manual_seed(1)\n"
    good = "done = torch.cuda.Event()\ndone.record(torch.cuda.current_stream(x.device))\ntorch.cuda.synchronize(d)\n"
    assert len(unnamed_device_calls(bad)) == 3
    assert unnamed_device_calls(good) == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_cuda_call_names_its_device_or_stream(path):
    """The package's own code (the rule above); the allocator-wide `empty_cache` has no device to name."""
    assert unnamed_device_calls(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE))) == []
