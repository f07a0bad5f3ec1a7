"""Beam search with fixed shapes (`decoding.search_state`), its step replayed as a CUDA graph on a GPU.

A search of B images × K beams over at most T steps has the same shapes at every step, so on
CUDA a block of `CHECK_EVERY` steps is captured once per (decoder, B, K, T, context mode, map
sharpness, dtype, device) and replayed: one launch per block of words instead of some fifty per
word, and no Python in between. The graph works on its own static copy of the search's state; each
search copies its start into it, replays the block until the look after it finds no beam writing,
and copies its results to the host, where `decode` traces them. Searches that sample locations (hard attention's
mode="sample"), CPU searches and searches with `graphs=False` run the same blocks without a graph.

Each decoder keeps its graphs in a small least-recently-used cache (`MAX_GRAPHS`), so a demo whose
visitors move the beam and length sliders holds a bounded number. A graph is captured and
replayed outside any autocast region, in the model's own precision (`cuda_graphs`), in the
memory pool every graph of the process shares on that device. A capture refused before CUDA began
it, or a replay that fails, is logged once with its error; that search, and every later one of its
shape, runs without a graph. A capture that fails inside CUDA raises `CaptureBroken`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import fields, replace

import torch

from captioner.cuda_graphs import FELL_BACK, CaptureBroken, GraphCapture, first_line, no_autocast
from captioner.decoding.search_state import CHECK_EVERY, Search, fixed_step
from captioner.models.attention import SAMPLE
from captioner.models.decoder import AttentionDecoder, Joined

MAX_GRAPHS = 8  # graphs a decoder keeps, the least recently used dropped first
WARMUP = 1  # eager blocks on a side stream before a capture
RESULTS = ("scores", "word", "parent", "alpha", "loc")  # what a search's graph hands back

log = logging.getLogger(__name__)
_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder → OrderedDict {shape key: _Graphed}
_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder → {shape keys whose graph failed}
_LOCK = threading.Lock()  # one search at a time replays a graph: they share its static state


def replays(device: torch.device, mode: str, graphs: bool = True) -> bool:
    """Whether a fixed-shape search on `device` replays its step as a graph."""
    return graphs and mode != SAMPLE and GraphCapture.supported(device)


def fixed_steps(
    decoder: AttentionDecoder,
    s: Search,
    max_len: int,
    mode: str,
    generator,
    *,
    graphs: bool = True,
    sharpness: float | None = None,
) -> int:
    """Run the fixed-shape search on `s`, whose history has room for whole blocks
    (`search_state.fixed_length`); its fields then hold the results. Returns the steps taken."""
    if s.word.size(0) % CHECK_EVERY:
        raise ValueError(f"a fixed-shape search steps in blocks of {CHECK_EVERY}: room for {s.word.size(0)} steps")
    device = s.words.device
    if not replays(device, mode, graphs):
        return _eager(decoder, s, max_len, mode, generator, sharpness)
    # The sharpness is a number inside the captured kernels: a graph per value.
    key = (tuple(s.scores.shape), s.word.size(0), mode, sharpness, s.feats.dtype, device)
    with _LOCK:
        if key in _FAILED.setdefault(decoder, set()):
            return _eager(decoder, s, max_len, mode, generator, sharpness)
        try:
            with no_autocast(device):
                graphed = _cached(decoder, s, key, max_len, mode, sharpness)
                graphed.load(s)
                steps = _run(graphed.graph.replay, graphed.state)
        except CaptureBroken:
            _GRAPHS.get(decoder, {}).pop(key, None)
            raise
        except Exception as e:  # noqa: BLE001 - refused before capture, or a failed replay: go on without a graph
            _GRAPHS.get(decoder, {}).pop(key, None)
            _FAILED[decoder].add(key)
            log.warning(
                f"{FELL_BACK}: the search's graph for {key[0][0]} images x {key[0][1]} beams on {device} failed "
                f"({first_line(e)}); searches of that shape run without a graph from here"
            )
            return _eager(decoder, s, max_len, mode, generator, sharpness)
        for name in RESULTS:  # to the host, where `decode` traces them, before the next search overwrites them
            setattr(s, name, getattr(graphed.state, name).cpu())
    return steps


def _eager(decoder: AttentionDecoder, s: Search, max_len: int, mode: str, generator, sharpness) -> int:
    t = torch.zeros((), dtype=torch.long, device=s.words.device)
    return _run(lambda: _block(decoder, s, t, max_len, mode, generator, sharpness), s)


def _block(decoder: AttentionDecoder, s: Search, t: torch.Tensor, max_len: int, mode: str, generator, sharpness):
    """`CHECK_EVERY` steps of the search: what a graph holds."""
    for _ in range(CHECK_EVERY):
        fixed_step(decoder, s, t, max_len, mode, generator, sharpness)


def _cached(decoder: AttentionDecoder, s: Search, key: tuple, max_len: int, mode: str, sharpness) -> _Graphed:
    """The decoder's graph for `key`, captured now if it has none (dropping the least recently used)."""
    graphs = _GRAPHS.setdefault(decoder, OrderedDict())
    if key in graphs:
        graphs.move_to_end(key)
        return graphs[key]
    while len(graphs) >= MAX_GRAPHS:
        graphs.popitem(last=False)
    graphs[key] = _Graphed(decoder, s, max_len, mode, sharpness)
    return graphs[key]


def _run(block, s: Search) -> int:
    """Run blocks of steps until none writes (the host looks after each) or the history is full."""
    T = s.word.size(0)
    for steps in range(CHECK_EVERY, T, CHECK_EVERY):
        block()
        if not bool(s.writing.any()):
            return steps
    block()
    return T


def _copy(value):
    if isinstance(value, Joined):
        return Joined(*(x.clone() for x in value))
    return value.clone() if torch.is_tensor(value) else value


class _Graphed:
    """A captured fixed-shape step on a static copy of a search's state."""

    def __init__(self, decoder: AttentionDecoder, s: Search, max_len: int, mode: str, sharpness: float | None):
        self.state = replace(s, **{f.name: _copy(getattr(s, f.name)) for f in fields(s)})
        self.t = torch.zeros((), dtype=torch.long, device=s.words.device)
        capture = GraphCapture(s.words.device)

        def block():
            _block(decoder, self.state, self.t, max_len, mode, None, sharpness)

        with capture.side():
            for _ in range(WARMUP):
                block()
        self.graph = capture.capture(block, what=f"the search for {tuple(s.scores.shape)} (images, beams)")

    def load(self, s: Search) -> None:
        """Copy a new search's start into the graph's state."""
        for f in fields(s):
            target, value = getattr(self.state, f.name), getattr(s, f.name)
            if isinstance(target, Joined):
                for a, b in zip(target, value):
                    a.copy_(b)
            else:
                target.copy_(value)
        self.t.zero_()
