"""Decoding a trained decoder's captions with their maps.

`settings` and `beams` need no torch; on PyTorch:

    from captioner.decoding.decode import decode
    from captioner.decoding.settings import Decoding
    found = decode(decoder, features, Decoding(beam_size=3), max_len=20)   # per image, best first
"""
