"""The synthetic scenes in COCO format (`python -m captioner.scenes.synthetic`)."""
