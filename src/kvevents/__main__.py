"""``python -m kvevents``: the same as the ``kvevents`` command."""

import sys

from kvevents.cli.main import main

sys.exit(main())
