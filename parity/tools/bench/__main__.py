"""`python -m parity.tools.bench ...`: the same options as `python -m parity bench` (parity/tools/bench/__init__.py)."""

import sys

from parity.tools.bench import main

sys.exit(main())
