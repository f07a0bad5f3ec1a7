"""The web demo: the page (`app`), its handlers, what it says about the model (`card`) and its options."""
