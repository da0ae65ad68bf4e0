"""``python -m tiersync ...``: the ``tiersync`` command, for environments without the script on PATH."""

import sys

from tiersync.cli import main

sys.exit(main())
