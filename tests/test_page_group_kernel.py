"""kernel_lib.PAGE_LOAD with GROUP > 1 (page_group_load) launched directly, against a row-by-row reference over one
word buffer (host pages, device rows and the gaps between them): several entries per launch, fewer programs than
work items (a program's second pass walks several items), int32 and int64 indices, pages of 2 to 8 tokens (not
only powers of two), packed and STRIDED device rows, calls cut mid-page and mid-group, and pages that are not
runs, out of range, or near the end of the index type.  Every word of the buffer is compared, so a store outside
a valid pair's row fails.  On CPU the kernel runs in Triton's interpreter."""

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from hicache_core import kernel_lib as kl  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ENTRIES = 3


def _case(seed: int, ps: int, width: int, group: int, strided: bool, n_ents: int, programs: int,
          dtype: torch.dtype, partial: bool, pages: int = 0) -> None:
    rnd = random.Random(seed)
    page_tokens = 1 << (ps - 1).bit_length()
    cap_pages, rows = 6, 7 * ps + 3
    cap, words = cap_pages * ps, ps * width
    host_page = [words + rnd.choice([0, 2, 8]) for _ in range(ENTRIES)]  # padding between host pages
    stride = [width + (rnd.choice([2, 6]) if strided else 0) for _ in range(ENTRIES)]
    at, host_off, dev_off = 64, [], []
    for e in range(ENTRIES):
        host_off.append(at)
        at += cap_pages * host_page[e] + 32
    for e in range(ENTRIES):
        dev_off.append(at)
        at += rows * stride[e] + 32
    buf = -1.0 - torch.arange(at + 64, dtype=torch.float32)  # every word distinct: any stray store shows
    for e in range(ENTRIES):
        span = cap_pages * host_page[e]
        buf[host_off[e]:host_off[e] + span] = 1 + torch.rand(span, generator=torch.Generator().manual_seed(seed + e))
    pages = pages or rnd.randint(2, 5)
    n = pages * ps - (rnd.randint(1, ps - 1) if partial else 0)
    hp = rnd.sample(range(cap_pages), pages)
    dp = rnd.sample(range(rows // ps), pages)
    h = [hp[k] * ps + i for k in range(pages) for i in range(ps)][:n]
    d = [dp[k] * ps + i for k in range(pages) for i in range(ps)][:n]
    top = 2**63 if dtype == torch.int64 else 2**31
    for _ in range(rnd.randint(0, 3)):
        t = rnd.randrange(n)
        p = t // ps
        kind = rnd.choice(["neg", "top", "cap", "row", "mid-page", "scattered", "top-run"])
        if kind == "neg":
            h[t] = -rnd.randint(1, 5)
        elif kind == "top":
            h[t] = top - 1 - rnd.randint(0, 3)
        elif kind == "cap":
            h[t] = cap + rnd.randint(0, 3)
        elif kind == "row":
            d[t] = rows + rnd.randint(0, 3)
        elif kind == "mid-page":  # a page-long host run starting mid-page
            s = rnd.randint(1, ps - 1)
            for i in range(p * ps, min(n, p * ps + ps)):
                h[i] = (hp[p] * ps + s + i - p * ps) % cap
        elif kind == "scattered":
            d[t] = rnd.choice([r for r in range(rows) if r not in d])
        else:  # a device run whose end would wrap a sum past the bound
            for i in range(p * ps, min(n, p * ps + ps)):
                d[i] = top - ps + i - p * ps
    valid = [(a, b) for a, b in zip(h, d) if 0 <= a < cap and 0 <= b < rows]
    if len({b for _, b in valid}) != len(valid):
        pytest.skip("two valid pairs write one row")
    ents = rnd.sample(range(ENTRIES), n_ents)
    ref = buf.clone()
    for e in ents:
        for a, b in valid:
            src = host_off[e] + (a // ps) * host_page[e] + (a % ps) * width
            ref[dev_off[e] + b * stride[e]:][:width] = buf[src:src + width]
    out = buf.to(DEVICE)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    kl.PAGE_LOAD[(programs,)](
        out, torch.tensor(h, dtype=dtype, device=DEVICE), torch.tensor(d, dtype=dtype, device=DEVICE), n,
        i64(ents), n_ents, i64(dev_off), i64(stride), i64(host_off), i64(host_page), i64([width] * ENTRIES), cap, rows,
        WIDTH=width, BLOCK=1 << (width - 1).bit_length(), TOKENS=min(4, page_tokens), PAGE_TOKENS=page_tokens, VEC=1,
        PART=1 << (words - 1).bit_length(), PARTS=1, R1=0, R2=0, R3=0, R4=0, STAGES=1, STRIDED=strided,
        PAGE_SIZE=ps, GROUP=group)
    bad = (out.cpu() != ref).nonzero().flatten()
    assert bad.numel() == 0, (n, h, d, ents, bad[:8].tolist())


@pytest.mark.parametrize("seed", range(24))
def test_grouped_page_load_matches_rows(seed):
    """A seeded mix of page sizes, widths, groups, entries, programs, index types and bad pairs (see the module
    docstring): every word as the row-by-row reference leaves it."""
    r = random.Random(seed * 7)
    _case(seed, ps=r.choice([2, 3, 5, 8]), width=r.choice([1, 3, 4]), group=r.choice([2, 4, 8]),
          strided=seed % 2 == 1, n_ents=r.randint(1, 3), programs=r.choice([1, 2, 64]),
          dtype=(torch.int32, torch.int64)[seed // 2 % 2], partial=seed % 3 == 0)


def test_grouped_page_load_second_pass_walks_every_item_of_a_program():
    """One program, two entries, five pages in groups of four (the second group cut short) of which the last
    is cut mid-page: the second pass must gather pages of both items of both entries."""
    _case(1, ps=3, width=2, group=4, strided=True, n_ents=2, programs=1, dtype=torch.int32, partial=True, pages=5)
