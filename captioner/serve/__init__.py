"""Serving a trained model: the `Captioner` API and what is built on it."""
