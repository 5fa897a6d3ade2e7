"""``python -m ff_core.cli ARGS``: the ``ff`` command."""

import sys

from ff_core.cli import main

sys.exit(main())
