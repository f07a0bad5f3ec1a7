"""Beam search with fixed shapes (`models.decode`), its step replayed as a CUDA graph on a GPU.

A search of B images × K beams over at most T steps has the same shapes at every step, so on
CUDA its step is captured once per (decoder, B, K, T, context mode, dtype) and replayed: one
launch per word instead of some fifty, and no Python in between. The graph works on its own
static copy of the search's state; each search copies its start into it, replays the step,
looks at the device every `CHECK_EVERY` steps to see whether a beam still writes, and leaves
its results in the copy for `decode` to trace back. Searches that sample locations (hard
attention's mode="sample") and CPU searches run the same step without a graph.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import fields, replace

import torch

from captioner.models.decode import CHECK_EVERY, _Search, fixed_step
from captioner.models.decoder import SAMPLE, AttentionDecoder, Joined

_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder → {shape key: _Graphed}
_LOCK = threading.Lock()  # one search at a time replays a graph: they share its static state
WARMUP = 2  # eager steps on a side stream before a capture


def fixed_steps(decoder: AttentionDecoder, s: _Search, max_len: int, mode: str, generator) -> int:
    """Run the fixed-shape search on `s` (its fields then hold the results); returns the steps taken."""
    if not (s.words.is_cuda and mode != SAMPLE and torch.cuda.is_available()):
        t = torch.zeros((), dtype=torch.long, device=s.words.device)
        return _run(lambda: fixed_step(decoder, s, t, max_len, mode, generator), s, max_len)
    key = (tuple(s.scores.shape), s.word.size(0), mode, s.feats.dtype, s.feats.device)
    with _LOCK:
        graphs = _GRAPHS.setdefault(decoder, {})
        if key not in graphs:
            graphs[key] = _Graphed(decoder, s, max_len, mode)
        graphed = graphs[key]
        graphed.load(s)
        steps = _run(graphed.graph.replay, graphed.state, max_len)
        for f in fields(s):  # the results, for `decode` to trace back (before the next search overwrites them)
            setattr(s, f.name, _copy(getattr(graphed.state, f.name)))
    return steps


def _run(step, s: _Search, max_len: int) -> int:
    for k in range(max_len + 1):
        step()
        if (k + 1) % CHECK_EVERY == 0 and not bool(s.writing.any()):  # the host looks every few steps
            return k + 1
    return max_len + 1


def _copy(value):
    if isinstance(value, Joined):
        return Joined(*(x.clone() for x in value))
    return value.clone() if torch.is_tensor(value) else value


class _Graphed:
    """A captured fixed-shape step on a static copy of a search's state."""

    def __init__(self, decoder: AttentionDecoder, s: _Search, max_len: int, mode: str):
        self.state = replace(s, **{f.name: _copy(getattr(s, f.name)) for f in fields(s)})
        self.t = torch.zeros((), dtype=torch.long, device=s.words.device)
        stream = torch.cuda.Stream(s.words.device)
        stream.wait_stream(torch.cuda.current_stream(s.words.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                fixed_step(decoder, self.state, self.t, max_len, mode, None)
        torch.cuda.current_stream(s.words.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fixed_step(decoder, self.state, self.t, max_len, mode, None)

    def load(self, s: _Search) -> None:
        """Copy a new search's start into the graph's state."""
        for f in fields(s):
            target, value = getattr(self.state, f.name), getattr(s, f.name)
            if isinstance(target, Joined):
                for a, b in zip(target, value):
                    a.copy_(b)
            else:
                target.copy_(value)
        self.t.zero_()
