"""On/off switches read from the environment (``HICACHE_REPLAY=0`` and the like), spelled alike everywhere."""

from __future__ import annotations

import os

__all__ = ["OFF", "ON", "env_on", "check_switch"]

#: Values that turn a switch off / on (compared lower-case).
OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")


def env_on(name: str) -> bool:
    """Whether the switch ``name`` is on: unset, or anything but one of :data:`OFF` (any case)."""
    return os.environ.get(name, "1").lower() not in OFF


def check_switch(setter: str, env: str, enabled: object) -> None:
    """Refuse a ``set_*(enabled)`` argument that is not a bool, an int or ``None``: a string such as ``"0"`` or
    ``"off"`` would be truthy and turn the switch on.

    :raises TypeError: naming ``setter``'s argument and the fix (``env``, the switch's variable, for text)."""
    if enabled is not None and not isinstance(enabled, int):  # bool is an int
        raise TypeError(f"{setter}(enabled) must be True, False or None (re-read {env}), got "
                        f"{type(enabled).__name__} {enabled!r}; for a switch spelled as text, set {env} and pass None")
