"""``python -m hicache_core.cli``: the ``hicache`` command, as ``python -m hicache_core`` runs it."""

import sys

from .command import main

if __name__ == "__main__":  # importing this module (a tool walking the package's modules) runs nothing
    sys.exit(main())
