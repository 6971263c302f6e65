"""Every error hicache raises, in one place.

Each class is a contract: callers may catch it, and its message names the
offending argument and the fix.  Transfer argument errors subclass
``ValueError`` / ``TypeError`` so that code written against SGLang's pools
(which raise those) keeps working.
"""

from __future__ import annotations

__all__ = [
    "HicacheError",
    "ConfigError",
    "RegistryError",
    "DuplicateRegistrationError",
    "PluginLoadError",
    "UnknownLayoutError",
    "ResolutionError",
    "SpecError",
    "AllocatorError",
    "PoolExhaustedError",
    "DoubleFreeError",
    "ForeignSlotError",
    "AllocatorArgumentError",
    "AllocSizeError",
    "FreePageError",
    "TransferArgumentError",
    "IndexShapeError",
    "IndexLengthMismatchError",
    "IndexDtypeError",
    "PageMultipleError",
    "PageAlignmentError",
    "IndexRangeError",
    "IndexDeviceError",
    "LayerIdError",
    "DuplicateIndexError",
    "UnallocatedSlotError",
    "DeviceBufferError",
    "HostBufferError",
    "TakeoverTableError",
]


class HicacheError(Exception):
    """Base class of every error raised by hicache."""


class ConfigError(HicacheError, ValueError):
    """An environment switch (``HICACHE_*``) or a strategy option has a value hicache cannot use.

    :param setting: the variable or option whose value it is, where the error is about a user's setting (not, say, a
        plugin whose kernel lacks a parameter); ``auto`` raises these rather than serving the pool without its kernel.
    """

    def __init__(self, message: str, *, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting


# --- registry -------------------------------------------------------------


class RegistryError(HicacheError):
    """The plugin registry is inconsistent."""


class DuplicateRegistrationError(RegistryError):
    """Two distributions registered the same layout name, strategy name or strategy key.

    Raised when a pool asks for the layout or key involved; every other layout
    and key keeps working (see :attr:`hicache_core.registry.Registry.conflicts`).
    """


class PluginLoadError(RegistryError):
    """A plugin that was explicitly requested could not be loaded."""


class UnknownLayoutError(RegistryError, ValueError):
    """No installed plugin provides the requested layout."""


class ResolutionError(RegistryError, ValueError):
    """No strategy serves a (layout, io_backend, sharded) key for a pool spec."""


# --- specs ----------------------------------------------------------------


class SpecError(HicacheError, ValueError):
    """A pool spec or layer map is malformed."""


# --- allocator ------------------------------------------------------------


class AllocatorError(HicacheError, ValueError):
    """Base class of host slot allocator errors."""


class PoolExhaustedError(AllocatorError):
    """Not enough free host slots for an allocation."""


class DoubleFreeError(AllocatorError):
    """A slot was freed that is not currently allocated."""


class ForeignSlotError(AllocatorError):
    """A slot outside this pool's capacity was passed to ``free``."""


class AllocatorArgumentError(AllocatorError, TypeError):
    """``alloc``'s size is not an int, or ``free``'s indices are not an integer tensor with readable values."""


# --- transfer arguments ---------------------------------------------------


class TransferArgumentError(HicacheError, ValueError):
    """A transfer was called with bad arguments; nothing was written."""


class IndexShapeError(TransferArgumentError):
    """An index tensor is not one-dimensional."""


class IndexLengthMismatchError(TransferArgumentError):
    """``host_indices`` and ``device_indices`` differ in length."""


class IndexDtypeError(TransferArgumentError, TypeError):
    """An index is not a dense int32 or int64 tensor whose memory holds the values it reads as."""


class PageMultipleError(TransferArgumentError):
    """An index count (or allocation size) is not a multiple of ``page_size``."""


class PageAlignmentError(TransferArgumentError):
    """Host indices are not whole pages (page-aligned, consecutive within a page)."""


class IndexRangeError(TransferArgumentError):
    """An index lies outside the host capacity or the device buffer rows."""


class IndexDeviceError(TransferArgumentError):
    """An index tensor lives on a device the transfer cannot use."""


class LayerIdError(TransferArgumentError):
    """A layer id is outside the device pool's layers."""


class DeviceBufferError(TransferArgumentError):
    """Device buffers do not match the pool spec (count, row bytes, device, layout)."""


class HostBufferError(TransferArgumentError):
    """Host buffers do not match the layout (shape, dtype, pinning), or two of them share memory."""


class DuplicateIndexError(TransferArgumentError):
    """A transfer writes one row twice: a host page repeats in a backup, or a device row in a load."""


class UnallocatedSlotError(TransferArgumentError):
    """``validate="strict"``: a transfer names host slots this pool's allocator has not handed out."""


# --- allocator errors that are also index-shape errors -----------------------


class AllocSizeError(AllocatorError, PageMultipleError):
    """``alloc(n)`` or ``free`` of a count that is not a positive multiple of ``page_size``."""


class FreePageError(AllocatorError, PageAlignmentError):
    """``free`` of slots that are not whole pages as ``alloc`` returned them."""


# --- configuration files ------------------------------------------------------


class TakeoverTableError(ConfigError):
    """The SGLang takeover table (shipped or ``HICACHE_SGLANG_TABLE``) is unreadable or malformed."""
