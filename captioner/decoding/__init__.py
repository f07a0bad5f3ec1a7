"""Decoding a trained decoder's captions with their maps: the settings (`settings`, no torch), the beam
search over NumPy arrays that both runtimes drive (`beams`, no torch), and on PyTorch `decode` and
`beam_search` (`decode`), sampling (`sampling`) and the fixed-shape search a GPU compiles (`search_state`).

    from captioner.decoding.decode import decode
    from captioner.decoding.settings import Decoding
    found = decode(decoder, features, Decoding(beam_size=3), max_len=20)   # per image, best first
"""
