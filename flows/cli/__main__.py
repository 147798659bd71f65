"""``python -m kiln.flows.cli``: the ``kiln`` command, as the tests and the daemon start it."""

import sys

from kiln.flows.cli import main

sys.exit(main())
