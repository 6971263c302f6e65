"""``load_plugin``: SGLang's ``sglang.srt.plugins`` entry point.

Registers AROUND hooks with SGLang's ``HookRegistry`` on the concrete host-pool
classes (transfers, ``init_kv_buffer``, the storage-tier page API) and an AFTER
hook on ``ServerArgs.add_cli_args`` (hicache's layouts as ``--hicache-mem-layout``
choices).  Idempotent: a second call in the same process (SGLang calls its
plugins once per process -- scheduler, detokenizer, workers) registers
nothing twice.  Imports only SGLang's hook registry; the target modules are
imported by ``HookRegistry.apply_hooks`` when it resolves the targets.
"""

from __future__ import annotations

import logging
from typing import Callable

from . import hooks, storage
from .buffers import destroy_mla, init_transfer_views
from .plugin_layouts import extend_layout_choices
from ... import __version__
from .mode import ENV_MODE, current_mode, table_error
from ...errors import TakeoverTableError
from .takeover import active_table

__all__ = ["load_plugin", "HOOK_TARGETS", "AFTER_TARGETS"]

logger = logging.getLogger(__name__)

_PH = "sglang.srt.mem_cache.pool_host"
_PAGE_CLASSES = ("mla.MLATokenToKVPoolHost", "mha.MHATokenToKVPoolHost")

#: Dotted SGLang target -> our AROUND hook.
HOOK_TARGETS: dict[str, Callable] = {
    **{f"{_PH}.{cls}.{name}": getattr(storage, name) for cls in _PAGE_CLASSES for name in storage.PAGE_METHODS},
    f"{_PH}.mla.MLATokenToKVPoolHost.init_kv_buffer": hooks.init_kv_buffer,
    f"{_PH}.mla.MLATokenToKVPoolHost.backup_from_device_all_layer": hooks.backup_all,
    f"{_PH}.mla.MLATokenToKVPoolHost.load_to_device_per_layer": hooks.load_layer,
    f"{_PH}.mla.MLATokenToKVPoolHost._backup_from_device_per_layer": hooks.backup_layer_mla,
    f"{_PH}.mla.MLATokenToKVPoolHost.destroy": destroy_mla,
    f"{_PH}.mha.MHATokenToKVPoolHost.init_kv_buffer": hooks.init_kv_buffer,
    f"{_PH}.mha.MHATokenToKVPoolHost._initialize_transfer_views": init_transfer_views,
    f"{_PH}.mha.MHATokenToKVPoolHost.backup_from_device_all_layer": hooks.backup_all,
    f"{_PH}.mha.MHATokenToKVPoolHost.load_to_device_per_layer": hooks.load_layer,
    f"{_PH}.dsa.DSAIndexerPoolHost.backup_from_device_all_layer": hooks.backup_all,
    f"{_PH}.dsa.DSAIndexerPoolHost.load_to_device_per_layer": hooks.load_layer,
    f"{_PH}.dsa.DSAIndexerPoolHost._backup_from_device_per_layer": hooks.backup_layer_indexer,
}
#: Dotted SGLang target -> our AFTER hook.
AFTER_TARGETS: dict[str, Callable] = {
    "sglang.srt.server_args.ServerArgs.add_cli_args": extend_layout_choices,
}

#: What each mode means, for the line :func:`load_plugin` logs.
_MODE_SAYS = {
    "measured": "hicache serves the cells SGLang cannot serve and those the takeover table takes over",
    "all": "hicache serves every cell it resolves",
    "gaps": "hicache serves only the cells SGLang cannot serve",
    "off": "SGLang's own methods serve every call",
}


def load_plugin() -> None:
    """Register the hooks (once per process) and apply them.

    SGLang's ``load_plugins`` applies hooks once, after running every plugin: called from there (its current plugin
    source is set) this only registers, since a target patched now would never take the hooks that plugins run after
    this one register on it (SGLang skips patched targets).  A direct call (tests, engines embedding SGLang) applies
    them too.

    In ``measured`` mode an unreadable or malformed takeover table is logged at ERROR, naming the file and the
    fix; the hooks stay in place and serve only the cells SGLang cannot until it is fixed (raising made SGLang log
    "Failed to execute general plugin: hicache" with a traceback, as if nothing had been registered).
    """
    from sglang.srt.plugins import hook_registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = 0
    for targets, kind in ((HOOK_TARGETS, HookType.AROUND), (AFTER_TARGETS, HookType.AFTER)):
        for target, hook in targets.items():
            if any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
                continue
            HookRegistry.register(target, hook, kind)
            registered += 1
    source = getattr(hook_registry, "_current_plugin_source", None)
    if source is None or source.get() is None:  # not inside load_plugins(), which applies them after every plugin
        HookRegistry.apply_hooks()
    logger.debug("hicache SGLang hooks registered on %d targets", len(HOOK_TARGETS) + len(AFTER_TARGETS))
    mode = current_mode()
    if registered:  # once per process: SGLang's log says the plugin ran, this says what it does now
        logger.info("hicache %s: SGLang bridge loaded; %s=%s (read at every call): %s", __version__, ENV_MODE, mode,
                    _MODE_SAYS[mode])
    if mode == "measured":
        try:
            active_table()
        except TakeoverTableError as exc:
            table_error(exc)
