"""Data: images, caption files (COCO, Karpathy), object boxes, the feature cache, and a prepared
data directory read back as batches (`dataset.CaptionData`). Above the models: it uses the
encoder's spec and the vocabulary."""
