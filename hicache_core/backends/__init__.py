"""The core's generic backends: ``reference`` (the oracle) and ``direct`` (copy engine)."""
