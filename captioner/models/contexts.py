"""How a step turns its map α_t into the context ẑ_t: the expected context Σ_i α_ti a_i (soft attention,
§4.2), or one location's annotation, the map's likeliest or one drawn from it (hard attention, §4.1)."""

EXPECTED, SAMPLE, ARGMAX = "expected", "sample", "argmax"
CONTEXT_MODES = (EXPECTED, SAMPLE, ARGMAX)
