"""`python -m captioner ...`: the same as the `captioner` command."""

import sys

from captioner.cli.main import main

sys.exit(main())
