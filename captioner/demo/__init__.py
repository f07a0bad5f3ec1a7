"""The web demo: the page (`app`), its handlers, what it says about the model (`card`), its
options, and the bundled model's build (`python -m captioner.demo.build`)."""
