"""SGLang bridge: hicache strategies serve SGLang's HiCache host-pool transfers.

SGLang (0.5.23 tested) loads :func:`load_plugin` through its
``sglang.srt.plugins`` entry point; it registers AROUND hooks on the host pool
classes with SGLang's ``HookRegistry``.  No SGLang source is patched.  See
``docs/sglang.md``.  Importing this package imports neither SGLang nor Triton.
"""

from __future__ import annotations

from .mode import DEFAULT_MODE, ENV_MODE, MODES, current_mode
from .plugin import AFTER_TARGETS, HOOK_TARGETS, load_plugin
from .takeover import ENV_TABLE, load_table

__all__ = ["load_plugin", "HOOK_TARGETS", "AFTER_TARGETS", "ENV_MODE", "ENV_TABLE", "MODES", "DEFAULT_MODE", "current_mode", "load_table"]
