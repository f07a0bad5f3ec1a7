"""Train and evaluate: `python train.py prepare|fit|evaluate ...` (see --help).

The same as `captioner-train` from an installed package; the command line is `captioner.cli.train`.
"""

import sys

from captioner.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
