"""Messages logged once per process: settings and files that are read again at every call or pool."""

from __future__ import annotations

import logging

__all__ = ["log_once", "forget_logged"]

_logged: set[tuple[str, int, str]] = set()


def log_once(logger: logging.Logger, level: int, message: str) -> bool:
    """Log ``message`` at ``level`` through ``logger`` the first time this process sees it; whether it was logged."""
    key = (logger.name, level, message)
    if key in _logged:
        return False
    _logged.add(key)
    logger.log(level, "%s", message)
    return True


def forget_logged() -> None:
    """Log every message again from now on (tests that check a once-only message)."""
    _logged.clear()
