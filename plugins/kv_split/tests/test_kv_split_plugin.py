"""Registration of the kv_split plugin: keys, laziness."""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hicache_core import LayerMap, PoolSpec, create_registry  # noqa: E402


def test_kernel_strategy_registered_for_both_sharded_keys():
    reg = create_registry()
    for sharded in (False, True):
        names = [i.name for i in reg.candidates("page_first_kv_split", "kernel", sharded)]
        assert names[0] == "page_first_kv_split.kernel"
    info, record = reg.strategies["page_first_kv_split.kernel"]
    assert (info.io_backend, info.layouts, info.sharded) == ("kernel", ("page_first_kv_split",), (False, True))
    assert record.dist == "hicache-kv-split"
    assert reg.layouts["page_first_kv_split"][1].dist == "hicache-kv-split"


def test_sharded_spec_resolves_to_the_kernel():
    spec = PoolSpec.mla(layer_map=LayerMap.sharded_cp(61, 4, 2), kv_lora_rank=512, qk_rope_head_dim=64,
                        dtype=torch.bfloat16, page_size=64, capacity=128,
                        device="cuda" if torch.cuda.is_available() else "cpu")
    res = create_registry().resolve(spec, "page_first_kv_split", "kernel")
    assert res.info.name == "page_first_kv_split.kernel" and res.rejected == ()


def test_registration_and_resolution_import_no_triton():
    code = (
        "import sys, torch\n"
        "from hicache_core import LayerMap, PoolSpec, create_registry\n"
        "import hicache_core.kernel_support as ks\n"
        "ks.interpreter_problem = lambda: None  # resolution, not a kernel run: Triton 3.6's interpreter does not matter\n"
        "spec = PoolSpec.mla(layer_map=LayerMap.sharded_cp(8, 2, 1), kv_lora_rank=8, qk_rope_head_dim=4,"
        " dtype=torch.bfloat16, page_size=1, capacity=4)\n"
        "create_registry().resolve(spec, 'page_first_kv_split', 'kernel')\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)[:5]\n"
        "print('ok')\n"
    )
    env = dict(os.environ, HICACHE_PLUGINS="core,kv_split", TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
