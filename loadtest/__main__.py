"""`python -m loadtest`: see loadtest/cli.py (or `python -m loadtest --help`)."""

import sys

from loadtest.cli import main

sys.exit(main())
