"""Training objectives: the soft loss of eq. (14), hard attention's REINFORCE, self-critical
training on CIDEr-D, and the attention terms (view consistency, attention correctness)."""
