"""Registration only: no Triton import here."""

from __future__ import annotations

from typing import Callable

from hicache_core import Layout, hookimpl

from .layout import LAYOUT


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(LAYOUT)
