"""``python -m viiwork.agent.host.doctor --markdown``: print docs/doctor.md from the check registry."""

import sys

from viiwork.agent.host.doctor.markdown import main

sys.exit(main())
