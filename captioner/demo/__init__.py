"""The web demo."""
