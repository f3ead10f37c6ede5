"""``python -m lowbitcc`` is the ``lowbitcc`` console command."""

import sys

from lowbitcc.tools.cli import main

sys.exit(main())
