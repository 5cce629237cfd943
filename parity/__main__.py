"""`python -m parity ...`: see parity/cli.py."""

import sys

from parity import cli

sys.exit(cli.main())
