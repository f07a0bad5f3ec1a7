"""Serving a trained model: the `Captioner` API, batched requests, bulk captioning, heatmaps,
the bundled model, and `captioner export`."""
