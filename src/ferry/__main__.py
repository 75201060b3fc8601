"""`python -m ferry ...` is the `ferry` command (torchrun starts programs this way)."""

import sys

from ferry.cli import main

sys.exit(main())
