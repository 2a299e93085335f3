"""``python -m replay``: the same as the ``replay`` command."""

import sys

from replay.cli.main import main

sys.exit(main())
