"""``python -m hicache_core``: the ``hicache`` command, where its console script is not on PATH."""

import sys

from .cli import main

if __name__ == "__main__":  # importing this module (a tool walking the package's modules) runs nothing
    sys.exit(main())
