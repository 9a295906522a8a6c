"""``python -m viiwork.agent.cli``: the same as ``viiworkctl``."""

import sys

from viiwork.agent.cli import main

sys.exit(main())
