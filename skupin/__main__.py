"""`python -m skupin`: the command line."""

import sys

from skupin.cli import main

sys.exit(main())
