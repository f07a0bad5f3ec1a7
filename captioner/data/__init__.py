"""Data: caption files, images, object boxes, the feature cache, and training batches."""
