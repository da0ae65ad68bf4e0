"""``python -m tiersync.demo``: see :func:`tiersync.demo.main`."""

import sys

from tiersync.demo import main

sys.exit(main())
