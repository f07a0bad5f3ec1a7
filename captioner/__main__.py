"""`python -m captioner caption IMG... --checkpoint CKPT` (same as the `captioner` command)."""
import sys

from .cli import main

sys.exit(main())
