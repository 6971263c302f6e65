"""``python -m hicache_core``: the ``hicache`` command, where its console script is not on PATH."""

import sys

from .cli import main

sys.exit(main())
