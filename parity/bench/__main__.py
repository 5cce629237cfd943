"""`python -m parity.bench ...`: the same options as `python -m parity bench` (parity/bench/__init__.py)."""

import sys

from parity.bench import main

sys.exit(main())
