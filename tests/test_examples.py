"""The out-of-tree example plugin (examples/hicache_example): installed by the test set-up, served, bounds-safe.

The conformance kit runs on it with the rest of the suite (``hicache_core/testing``, every installed layout).
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from hicache_core import HostKVPool, LayerMap, PoolSpec, create_registry
from hicache_core.kernel_support import interpreting

from fakes import pool_device

pytestmark = pytest.mark.skipif(
    not any(ep.name == "example" for ep in importlib.metadata.entry_points(group="hicache")),
    reason="examples/hicache_example is not installed (bash dev/bootstrap.sh --test installs it)",
)


def test_example_registers_its_layout_and_two_strategies() -> None:
    reg = create_registry(env={"HICACHE_PLUGINS": "core,example"})
    assert sorted(reg.layouts) == ["example_packed"]
    assert sorted(reg.plugins[1].strategies) == ["example.engine", "example.kernel"]


@pytest.mark.parametrize("io_backend", ["example_engine", "kernel"])
def test_out_of_range_device_resident_indices_touch_nothing(io_backend: str) -> None:
    device = pool_device(io_backend)
    if device == "cpu" and io_backend == "kernel" and not interpreting():
        pytest.skip("Triton kernels on CPU need TRITON_INTERPRET=1")
    spec = PoolSpec.mha(layer_map=LayerMap.unsharded(2), head_num=1, head_dim=8, dtype=torch.float16, page_size=4,
                        capacity=8, device=device)
    gen = torch.Generator().manual_seed(0)
    dev = {c: [torch.randint(-100, 100, (12, 1, 8), generator=gen).half().to(device) for _ in range(2)] for c in "kv"}

    def snapshot() -> dict[str, list[torch.Tensor]]:
        if device == "cuda":
            torch.cuda.synchronize()
        return {c: [t.cpu().clone() for t in dev[c]] for c in "kv"}

    pool = HostKVPool(spec, "example_packed", io_backend, dev, registry=create_registry(
        env={"HICACHE_PLUGINS": "core,example"}), validate="shapes")
    host = pool.host_buffers["packed"]
    host.fill_(0xA5)
    # The pool range-checks CPU indices; calling the strategy directly, as with device-resident indices
    # under validate="shapes", leaves the out-of-range rows to the strategy.
    strategy = pool.strategy
    h = torch.tensor([0, 1, 2, 99], dtype=torch.int64, device=device)
    d = torch.tensor([4, 5, -1, 6], dtype=torch.int64, device=device)
    strategy.backup(pool.binding, h, d, None)
    original = snapshot()
    rows = host.view(2, 8, 2, 16)  # [layer, slot, component, 16 bytes]
    for layer in range(2):
        for c, comp in enumerate("kv"):
            for slot, row in ((0, 4), (1, 5)):
                assert torch.equal(rows[layer, slot, c], original[comp][layer][row, 0].view(torch.uint8))
    assert bool((rows[:, 2:] == 0xA5).all())
    h = torch.tensor([0, 50, 1, 1], device=device)
    d = torch.tensor([8, 9, 12, -3], device=device)
    strategy.load(pool.binding, h, d, 1)
    after = snapshot()
    for c in "kv":
        for layer in range(2):
            changed = [r for r in range(12) if not torch.equal(after[c][layer][r], original[c][layer][r])]
            assert changed == ([8] if layer == 1 and not torch.equal(original[c][1][8], original[c][1][4]) else [])
    assert torch.equal(after["k"][1][8, 0].view(torch.uint8), rows[1, 0, 0])


def test_the_example_engine_declares_the_rejection_the_kit_sees_on_a_gpu():
    """Copied as a starting point, the example must pass the kit on a GPU machine too: its CPU-only engine rejects
    the kit's GPU pools, which is a declared rejection (a skip), not an undeclared one (a failure)."""
    from hicache_core import create_registry
    from hicache_core.testing.conformance import CASES, classify_rejection

    rejection = classify_rejection(create_registry(), CASES[0], "example_packed", "example_engine", "example.engine",
                                   "cuda")
    assert rejection is not None and rejection.kind == "declared"


class _EngineEverywhere:
    """The example engine registered for every layout, as a vendor copying it would."""

    @staticmethod
    def _make(**options: object):  # type: ignore[no-untyped-def]
        from hicache_example.engine import EngineStrategy

        return EngineStrategy(**options)

    from hicache_core import hookimpl as _hookimpl

    @_hookimpl
    def hicache_register_strategies(self, register):  # type: ignore[no-untyped-def]
        from hicache_core import ANY_LAYOUT, StrategyInfo

        register(StrategyInfo("everywhere.engine", "engine_everywhere", (ANY_LAYOUT,), self._make, (False, True)))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_first_kv_split",
                                    "example_packed"])
def test_the_example_engine_copied_for_every_layout_is_byte_exact(layout: str) -> None:
    """Copied as a starting point and registered for every layout, the engine stays byte-exact: it reads each
    segment's host_view (it used to assume layer-major slots and wrote page-major layouts' bytes to the wrong
    place)."""
    from hicache_core.testing.conformance import CASES, check_strategy

    reg = create_registry(plugins=[("everywhere", _EngineEverywhere())])
    if layout not in reg.layouts:
        pytest.skip(f"{layout} is not installed")
    for case in CASES:
        if reg.layouts[layout][0].check(case.build(torch.device("cpu"))) is None:
            check_strategy(reg, case, layout, "engine_everywhere")
