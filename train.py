"""Train and evaluate: `python train.py prepare|fit|evaluate ...` (see --help)."""
import sys

from captioner.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
