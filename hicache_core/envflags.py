"""On/off switches read from the environment (``HICACHE_REPLAY=0`` and the like), spelled alike everywhere."""

from __future__ import annotations

import os

__all__ = ["OFF", "ON", "env_on"]

#: Values that turn a switch off / on (compared lower-case).
OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")


def env_on(name: str) -> bool:
    """Whether the switch ``name`` is on: unset, or anything but one of :data:`OFF` (any case)."""
    return os.environ.get(name, "1").lower() not in OFF
