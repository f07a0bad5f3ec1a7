"""Training: `prepare` and `fit`."""
