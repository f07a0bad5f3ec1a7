"""Decoding a trained decoder's captions with their maps: the one batched beam search (greedy is its
beam size 1), written once for PyTorch and onnxruntime, sampling beside it, the settings that choose
between them, and the fixed-shape search state and compiled steps they share.

    from captioner.decoding import Decoding, decode
    found = decode(decoder, features, Decoding(beam_size=3), max_len=20)   # per image, best first
"""

from captioner.decoding.beams import Hypothesis
from captioner.decoding.settings import Decoding, decode

__all__ = ["Decoding", "Hypothesis", "beam_search", "decode"]


def __getattr__(name: str):
    # The search on PyTorch loads torch: imported when asked for, so that the ONNX path does not.
    if name == "beam_search":
        from captioner.decoding.decode import beam_search

        return beam_search
    raise AttributeError(f"module 'captioner.decoding' has no attribute {name!r}")
