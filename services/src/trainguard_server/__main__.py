"""``python -m trainguard_server`` = the ``trainguard`` command."""

import sys

from .cli import main

sys.exit(main())
