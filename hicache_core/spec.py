"""Pool specs: what a KV pool stores, per token and per layer, and which layers.

A :class:`PoolSpec` is layout-agnostic.  It lists *components* (one row per
token per layer each: ``k`` and ``v`` for MHA, ``kv`` for MLA, extra rows such
as a DSA indexer key), the page size, the host capacity and a
:class:`LayerMap` from device layer ids to host layer slots.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from .errors import SpecError

__all__ = ["LayerMap", "Component", "Part", "PoolSpec", "MHA", "MLA", "shard_range", "as_int"]

MHA = "mha"
MLA = "mla"


def as_int(value: object, name: str, error: type[Exception] = SpecError) -> int:
    """``value`` as an int (anything with ``__index__``, e.g. NumPy ints), else ``error`` naming ``name``.

    Floats, strings, ``None`` and bools are refused rather than truncated or guessed.
    """
    if isinstance(value, bool):
        raise error(f"{name} must be an int, got bool {value!r}; pass a whole number")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise error(f"{name} must be an int, got {type(value).__name__} {value!r}; pass a whole number") from None


def _dim(value: object, name: str, least: int = 1) -> int:
    """A model dimension: an int >= ``least``, else :class:`SpecError` naming it (``-2`` heads of ``-8`` would multiply
    out to a positive row)."""
    n = as_int(value, name)
    if n < least:
        raise SpecError(f"{name}={n} must be >= {least}")
    return n


def _layer_count(value: object, name: str) -> int:
    """A count of layers: an int >= 0, else :class:`SpecError` naming it."""
    return _dim(value, name, least=0)


def _as_bool(value: object, name: str) -> bool:
    """``value`` as a bool (NumPy bools too), else :class:`SpecError` naming ``name``: a string such as ``"False"``
    would be truthy, and an int would print as a number in strategy keys."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise SpecError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _int_tuple(value: object, name: str) -> tuple[int, ...]:
    """A sequence of ints as a tuple, else :class:`SpecError` naming ``name`` (an int or a string is no sequence)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SpecError(f"{name} must be a tuple of ints, got {type(value).__name__} {value!r}")
    return tuple(as_int(x, f"{name} entry") for x in value)


def _check_name(value: object, what: str) -> None:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{what} name must be a non-empty str, got {type(value).__name__} {value!r}")


#: Host bytes a pool may span: byte offsets and strides are 64-bit signed everywhere (views, kernels, copies).
MAX_POOL_BYTES = 2**63 - 1


def _extra(extra: object) -> tuple:
    """``extra`` components as a tuple; a lone :class:`Component` is refused naming the fix (it is not iterable)."""
    if isinstance(extra, Component) or isinstance(extra, (str, bytes)) or not isinstance(extra, Iterable):
        raise SpecError(f"extra must be a sequence of Component, got {type(extra).__name__} {extra!r}; "
                        "pass (component,)")
    return tuple(extra)


def _as_device(value: object) -> torch.device:
    """``value`` as a torch.device, else :class:`SpecError` naming ``device`` (torch's own error names no argument)."""
    try:
        return torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        raise SpecError(f"device must be a torch.device or a device string such as 'cuda:0' or 'cpu', got "
                        f"{type(value).__name__} {value!r}") from None


def _check_dtype(dtype: object, where: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise SpecError(f"{where}: dtype must be a torch.dtype (e.g. torch.bfloat16), got {type(dtype).__name__} {dtype!r}")
    return dtype


def shard_range(num_layers: int, shards: int, rank: int) -> tuple[int, int]:
    """Return ``[start, end)`` of the contiguous layer block owned by ``rank``.

    Same rule as SGLang's context-parallel layer split: the first
    ``num_layers % shards`` ranks own one extra layer.
    """
    num_layers, shards, rank = as_int(num_layers, "num_layers"), as_int(shards, "shards"), as_int(rank, "rank")
    if num_layers < 0:
        raise SpecError(f"num_layers={num_layers} must be >= 0")
    if shards < 1 or not 0 <= rank < shards:
        raise SpecError(f"shard rank {rank} is outside 0..{shards - 1} (shards={shards}); pass 0 <= rank < shards")
    base, rem = divmod(num_layers, shards)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


@dataclass(frozen=True)
class LayerMap:
    """Device layer id -> host layer slot, for the layers this rank owns.

    ``device_layers[i]`` is stored in host layer slot ``host_slots[i]`` (by
    default ``i``).  Device layer ids index the per-layer device buffer lists.
    ``host_layer_num`` may exceed the number of owned layers (SGLang sizes every
    rank's host pool for the largest shard, leaving a slot unused, and appends
    draft layers after that slot).

    :param device_layers: owned device layer ids, unique.
    :param host_layer_num: host layer slots to allocate (>= owned layers).
    :param num_device_layers: length of the device buffer lists (ids are < this).
    :param sharded: whether the device pool is layer-sharded (strategy key).
    :param host_slots: host slot of each owned layer (unique, < ``host_layer_num``);
        ``None`` packs them in order.
    """

    device_layers: tuple[int, ...]
    host_layer_num: int
    num_device_layers: int
    sharded: bool = False
    host_slots: tuple[int, ...] | None = None
    _slots: dict[int, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_device_layers", as_int(self.num_device_layers, "LayerMap num_device_layers"))
        object.__setattr__(self, "host_layer_num", as_int(self.host_layer_num, "LayerMap host_layer_num"))
        object.__setattr__(self, "sharded", _as_bool(self.sharded, "LayerMap sharded"))
        if self.num_device_layers < 0:
            raise SpecError(f"LayerMap num_device_layers={self.num_device_layers} must be >= 0 (the length of the "
                            "per-layer device buffer lists)")
        layers = _int_tuple(self.device_layers, "LayerMap device_layers")
        object.__setattr__(self, "device_layers", layers)
        if len(set(layers)) != len(layers):
            raise SpecError(f"layer map device_layers has duplicates: {layers}; each device layer maps to one host slot")
        if any(not 0 <= x < self.num_device_layers for x in layers):
            raise SpecError(
                f"layer map device_layers {layers} must lie in 0..{self.num_device_layers - 1} (num_device_layers)"
            )
        if self.host_layer_num < len(layers):
            raise SpecError(
                f"host_layer_num={self.host_layer_num} is smaller than the {len(layers)} owned layers; "
                "pass host_layer_num >= len(device_layers)"
            )
        slots = (tuple(range(len(layers))) if self.host_slots is None
                 else _int_tuple(self.host_slots, "LayerMap host_slots"))
        if len(slots) != len(layers) or len(set(slots)) != len(slots) or any(not 0 <= h < self.host_layer_num for h in slots):
            raise SpecError(
                f"layer map host_slots {slots} must give each of the {len(layers)} owned layers its own slot in "
                f"0..{self.host_layer_num - 1} (host_layer_num)"
            )
        object.__setattr__(self, "host_slots", slots)
        object.__setattr__(self, "_slots", dict(zip(layers, slots)))

    @classmethod
    def unsharded(cls, num_layers: int, *, draft_layers: int = 0) -> "LayerMap":
        """Every device layer on this rank, plus ``draft_layers`` appended MTP draft layers."""
        n = _layer_count(num_layers, "num_layers") + _layer_count(draft_layers, "draft_layers")
        return cls(tuple(range(n)), n, n, sharded=False)

    @classmethod
    def sharded_cp(
        cls, num_layers: int, shards: int, rank: int, *, draft_layers: int = 0, pad_to_largest: bool = False
    ) -> "LayerMap":
        """A contiguous context-parallel shard of ``num_layers`` over ``shards`` ranks.

        The device buffer lists hold all ``num_layers`` target layers (only the
        owned ones are read) followed by ``draft_layers`` draft layers, which
        every rank owns.  The host is compacted to the owned layers; with
        ``pad_to_largest`` the target part is sized for the largest shard and
        the drafts follow it (SGLang's rule: a smaller shard leaves a gap).
        """
        num_layers, draft_layers = _layer_count(num_layers, "num_layers"), _layer_count(draft_layers, "draft_layers")
        start, end = shard_range(num_layers, shards, rank)
        shards = as_int(shards, "shards")
        owned = tuple(range(start, end)) + tuple(range(num_layers, num_layers + draft_layers))
        targets = -(-num_layers // shards) if pad_to_largest else end - start  # exact: no float rounding
        slots = tuple(range(end - start)) + tuple(range(targets, targets + draft_layers))
        return cls(owned, targets + draft_layers, num_layers + draft_layers, sharded=shards > 1, host_slots=slots)

    def host_slot(self, device_layer: int) -> int | None:
        """Host slot of ``device_layer``, or ``None`` when this rank does not own it."""
        return self._slots.get(device_layer)

    def owns(self, device_layer: int) -> bool:
        return device_layer in self._slots

    def restrict(self, device_layers: Iterable[int]) -> "LayerMap":
        """The sub-map of a component present only on ``device_layers`` (compacted host slots)."""
        keep = set(device_layers)
        owned = tuple(d for d in self.device_layers if d in keep)
        return LayerMap(owned, len(owned), self.num_device_layers, self.sharded)  # packed slots


@dataclass(frozen=True)
class Part:
    """A named byte range of a component row (e.g. MLA ``latent`` and ``rope``)."""

    name: str
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        _check_name(self.name, "part")
        object.__setattr__(self, "offset", as_int(self.offset, f"part {self.name!r} offset"))
        object.__setattr__(self, "nbytes", as_int(self.nbytes, f"part {self.name!r} nbytes"))


@dataclass(frozen=True)
class Component:
    """One row per token per layer.

    :param name: component name (``k``, ``v``, ``kv``, ``index_k``...).
    :param row_bytes: bytes of one token's row in one layer.
    :param dtype: storage dtype for host buffers (bytes move regardless of it).
    :param parts: optional split of the row; layouts may store parts separately.
    :param layers: device layer ids where the component exists (``None``: all).
    """

    name: str
    row_bytes: int
    dtype: torch.dtype = torch.uint8
    parts: tuple[Part, ...] = ()
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_name(self.name, "component")
        item = torch.empty((), dtype=_check_dtype(self.dtype, f"component {self.name!r}")).element_size()
        object.__setattr__(self, "row_bytes", as_int(self.row_bytes, f"component {self.name!r} row_bytes"))
        if self.row_bytes <= 0 or self.row_bytes % item:
            raise SpecError(
                f"component {self.name!r}: row_bytes={self.row_bytes} must be a positive multiple of the "
                f"{self.dtype} item size {item}"
            )
        parts = tuple(self.parts) if isinstance(self.parts, (tuple, list)) else None
        if parts is None or not all(isinstance(p, Part) for p in parts):
            raise SpecError(f"component {self.name!r}: parts must be a tuple of Part(name, offset, nbytes), "
                            f"got {self.parts!r}")
        object.__setattr__(self, "parts", parts)
        if self.layers is not None:
            if isinstance(self.layers, (str, bytes)) or not isinstance(self.layers, Iterable):
                raise SpecError(f"component {self.name!r}: layers must be a tuple of device layer ids or None, "
                                f"got {type(self.layers).__name__} {self.layers!r}")
            layers = tuple(as_int(x, f"component {self.name!r} layers entry") for x in self.layers)
            if len(set(layers)) != len(layers):  # as a layer map's device_layers: each layer once
                raise SpecError(f"component {self.name!r}: layers {layers} repeat a device layer; list each once")
            object.__setattr__(self, "layers", layers)
        covered = 0
        for part in self.parts:
            if part.offset != covered or part.nbytes <= 0 or part.nbytes % item:
                raise SpecError(
                    f"component {self.name!r}: parts must tile the row in order with whole items, got {self.parts}"
                )
            covered += part.nbytes
        if self.parts and covered != self.row_bytes:
            raise SpecError(f"component {self.name!r}: parts cover {covered} of {self.row_bytes} row bytes")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PoolSpec:
    """What a KV pool holds.  Layout- and backend-agnostic.

    :param kind: pool kind, ``"mha"`` or ``"mla"`` (layouts may accept others).
    :param components: the per-token-per-layer rows.
    :param layer_map: owned device layers and their host slots.
    :param page_size: tokens per page; host slots are allocated in pages.
    :param capacity: host token slots (a multiple of ``page_size``).
    :param device: device of the device pool's buffers.
    :param head_num: MHA heads (informational; layouts may use it).
    """

    kind: str
    components: tuple[Component, ...]
    layer_map: LayerMap
    page_size: int
    capacity: int
    device: torch.device = torch.device("cpu")
    head_num: int = 1

    def __post_init__(self) -> None:
        dev = _as_device(self.device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())  # tensors report cuda:N
        object.__setattr__(self, "device", dev)
        if not isinstance(self.layer_map, LayerMap):
            raise SpecError(
                f"layer_map must be a LayerMap, got {type(self.layer_map).__name__} {self.layer_map!r}; "
                "pass e.g. LayerMap.unsharded(num_layers)"
            )
        object.__setattr__(self, "page_size", as_int(self.page_size, "page_size"))
        object.__setattr__(self, "capacity", as_int(self.capacity, "capacity"))
        object.__setattr__(self, "head_num", _dim(self.head_num, "head_num"))
        comps = tuple(self.components) if isinstance(self.components, (tuple, list)) else None
        if comps is None or not all(isinstance(c, Component) for c in comps):
            raise SpecError(f"components must be a tuple of Component(name, row_bytes, ...), got "
                            f"{type(self.components).__name__} {self.components!r}")
        object.__setattr__(self, "components", comps)
        if self.page_size < 1:
            raise SpecError(f"page_size={self.page_size} must be >= 1")
        if self.capacity < self.page_size or self.capacity % self.page_size:
            raise SpecError(
                f"capacity={self.capacity} must be a positive multiple of page_size={self.page_size}; "
                f"round it up to {max(1, -(-self.capacity // self.page_size)) * self.page_size}"
            )
        names = [c.name for c in self.components] + [p.name for c in self.components for p in c.parts]
        if not self.components or len(set(names)) != len(names):
            raise SpecError(f"component and part names must be non-empty and unique, got {names}")
        for comp in self.components:
            if comp.layers is not None and any(not 0 <= x < self.layer_map.num_device_layers for x in comp.layers):
                raise SpecError(f"component {comp.name!r} layers {comp.layers} exceed the device layers")
        if not any(self.component_map(c.name).host_layer_num for c in self.components):
            raise SpecError(
                f"the layer map has no host layer slot for any component (host_layer_num="
                f"{self.layer_map.host_layer_num}), so every page would be 0 bytes; give it at least one layer"
            )
        host_bytes = self.capacity * sum(c.row_bytes * self.component_map(c.name).host_layer_num
                                         for c in self.components)
        if host_bytes > MAX_POOL_BYTES:
            raise SpecError(f"the pool would span {host_bytes} host bytes (capacity={self.capacity} x rows x host "
                            f"layers), more than 64-bit byte offsets address ({MAX_POOL_BYTES}); reduce capacity")

    # -- convenience constructors -------------------------------------------
    @classmethod
    def mha(
        cls,
        *,
        layer_map: LayerMap,
        head_num: int,
        head_dim: int,
        dtype: torch.dtype,
        page_size: int,
        capacity: int,
        v_head_dim: int | None = None,
        device: torch.device | str = "cpu",
        extra: Sequence[Component] = (),
    ) -> "PoolSpec":
        """An MHA pool: components ``k`` (``head_num x head_dim``) and ``v`` (``head_num x v_head_dim``)."""
        item = torch.empty((), dtype=_check_dtype(dtype, "PoolSpec.mha")).element_size()
        head_num, head_dim = _dim(head_num, "head_num"), _dim(head_dim, "head_dim")
        vd = head_dim if v_head_dim is None else _dim(v_head_dim, "v_head_dim")
        comps = (Component("k", head_num * head_dim * item, dtype), Component("v", head_num * vd * item, dtype))
        return cls(MHA, comps + _extra(extra), layer_map, page_size, capacity, _as_device(device), head_num)

    @classmethod
    def mla(
        cls,
        *,
        layer_map: LayerMap,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        page_size: int,
        capacity: int,
        row_bytes: int | None = None,
        device: torch.device | str = "cpu",
        extra: Sequence[Component] = (),
    ) -> "PoolSpec":
        """An MLA pool: one ``kv`` row of ``kv_lora_rank + qk_rope_head_dim`` items, parts ``latent``/``rope``.

        ``row_bytes`` overrides the row size for packed FP8 rows (e.g. 656 bytes of
        uint8); such a row has no parts (layouts that store parts apart keep it whole).
        """
        item = torch.empty((), dtype=_check_dtype(dtype, "PoolSpec.mla")).element_size()
        kv_lora_rank = _dim(kv_lora_rank, "kv_lora_rank", least=0)
        qk_rope_head_dim = _dim(qk_rope_head_dim, "qk_rope_head_dim", least=0)
        rope = qk_rope_head_dim * item
        if row_bytes is None and kv_lora_rank + qk_rope_head_dim == 0:
            raise SpecError("kv_lora_rank=0 and qk_rope_head_dim=0 leave an empty row; pass the model's dimensions "
                            "(e.g. 512 and 64)")
        row = row_bytes if row_bytes is not None else (kv_lora_rank + qk_rope_head_dim) * item
        split = row_bytes is None and qk_rope_head_dim > 0 and kv_lora_rank > 0
        parts = (Part("latent", 0, row - rope), Part("rope", row - rope, rope)) if split else ()
        comps = (Component("kv", row, dtype, parts),)
        return cls(MLA, comps + _extra(extra), layer_map, page_size, capacity, _as_device(device))

    # -- derived ---------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.capacity // self.page_size

    @property
    def sharded(self) -> bool:
        return self.layer_map.sharded

    def component(self, name: str) -> Component:
        for comp in self.components:
            if comp.name == name:
                return comp
        if isinstance(name, Component):
            raise SpecError(f"pass a component's name, not the Component: {name.name!r}")
        raise SpecError(f"no component {name!r}; the spec has {[c.name for c in self.components]}")

    def component_map(self, name: str) -> LayerMap:
        """The layer map of one component (restricted when it lives on some layers only)."""
        comp = self.component(name)
        return self.layer_map if comp.layers is None else self.layer_map.restrict(comp.layers)

    @property
    def bytes_per_token(self) -> int:
        """Host bytes per token slot, all components and owned layers."""
        return sum(c.row_bytes * len(self.component_map(c.name).device_layers) for c in self.components)

    def describe(self) -> str:
        rows = "+".join(f"{c.name}:{c.row_bytes}B" for c in self.components)
        lm = self.layer_map
        shard = f", sharded {len(lm.device_layers)}/{lm.num_device_layers} layers" if lm.sharded else ""
        return f"{self.kind} [{rows}] x {len(lm.device_layers)} layers, page {self.page_size}{shard}"
