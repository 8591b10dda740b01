"""`python -m skupin.cli`: the command line."""

import sys

from skupin.cli import main

sys.exit(main())
