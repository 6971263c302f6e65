"""Page loads: whole host pages copied as flat words (:data:`hicache_core.kernel_lib.PAGE_LOAD`).

Where a layout keeps one layer's page as one contiguous run of rows (a layer-major host, or a
page-major one whose page holds each layer's rows together), a page is ``page_size * row`` contiguous
bytes on the host.  The row kernel moves a tile as ``[tokens, block]`` with ``block`` the next power of
two of the row, so a 656-byte row keeps 41 of 64 lanes busy, and reads the host row by row; the page
kernel reads each page in power-of-two pieces that add up to it exactly (a 64 x 656-byte page is
32 + 8 + 1 KiB; small pages several per work item, :func:`group_pages`, each padded to a power of two and masked to
the page) and stores it to the page's device rows: one run where device rows are packed (the device
token stride is the row), row by row where they are wider (``STRIDED``: the part of a row a host buffer
holds, e.g. the latent and the rope of MLA rows split over two host buffers, each loaded as its own
part by :func:`page_parts`).
A plugin offers it by re-exporting the kernel as ``PAGE_LOAD_KERNEL`` and setting
``KernelTuning.page_load``; :class:`hicache_core.rowcopy.RowKernelStrategy` then loads every
group :func:`group_reason` accepts through it (calls that TMA takes stay TMA's): by default with ``automatic``
(pages of at least :data:`AUTO_MIN_PART_BYTES` per host part), every group whose host pages allow it with
``pages=True`` or ``HICACHE_KERNEL_PAGES=1``.

Backups may copy whole pages the other way (:func:`backup_reason`): a plugin whose ``KERNEL`` declares ``PAGES``
and whose tuning has ``KernelTuning.page_backup`` backs up the groups :func:`backup_reason` accepts page by page
(``page_backups=True``: every group it allows; ``False``: none; unset: with ``automatic`` where
:data:`AUTO_PAGE_BACKUPS` is on, else none).

Nothing here imports Triton.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection

import torch

from .envflags import OFF, ON
from .errors import ConfigError

if TYPE_CHECKING:
    from .layout import HostPlan
    from .rowcopy_groups import RowGroup

__all__ = ["ENV_PAGES", "MAX_PAGE_TOKENS", "AUTO_MIN_PART_BYTES", "GROUP_BYTES", "PAGE_BACKUP_MAX_ROW_BYTES",
           "PAGE_BACKUP_MIN_PAGE_BYTES", "AUTO_PAGE_BACKUPS", "packed_host_rows", "automatic_backup_fit", "PagePart",
           "pages_mode", "pages_enabled", "page_parts", "strided", "group_reason", "backup_reason", "pieces",
           "group_pages", "launch_pieces"]

logger = logging.getLogger(__name__)

#: ``1``: page loads wherever a group allows them, ``0``: the row kernel for every load; unset: automatic (groups
#: whose parts' pages hold at least :data:`AUTO_MIN_PART_BYTES`).
ENV_PAGES = "HICACHE_KERNEL_PAGES"
#: Most tokens per page the kernel checks in one vector (its run check is one power-of-two block).
MAX_PAGE_TOKENS = 1024
#: Automatic page loads take a group only where a page of each of its host parts holds at least this many bytes.
#: Drawn when a page was one work item of the page kernel (before :data:`GROUP_BYTES`): pages of a few KiB kept
#: too few reads in flight per program.  On an
#: H100 (2026-12-07, docs/perf/runs.md, record call 47) fp8 576-byte MLA rows split over two host buffers, whose
#: 64-byte rope part makes 1 KiB pages in pages of 16, loaded bursts at 0.43 through page loads and 0.56 through the
#: row kernel; on the H200 (2026-12-01) MLA bf16 rows split 1024 + 128 B in pages of 64 (8 KiB rope pages) loaded
#: 10-11 points faster through page loads than through the row kernel.  The line between is not measured more
#: closely: it sits at the smallest page not measured behind, so that split MLA bf16 rows in pages of 16 (2 KiB rope
#: pages) keep page loads as before, and only pages of 1 KiB and less (fp8 rope parts at page 16, any part at pages
#: of a few tokens) go to the row kernel.  Grouped (record call 50, H100), 1 KiB rope pages still loaded 3 points
#: behind the row kernel (0.52-0.53 against 0.55-0.56) and 2 KiB ones 1-2 points (0.56-0.57 against 0.58): the
#: floor stays.
AUTO_MIN_PART_BYTES = 2048
#: Pages whose size padded to a power of two is at most half of this are read several per work item
#: (:func:`group_pages`), an item holding up to this many bytes (what one held where page loads were measured ahead of
#: the row kernel: 8 KiB rope pages, above); 0: one page per work item.  On an H100 (2026-12-07, record call 50)
#: load bursts of split MLA rows in pages of 16 went from 0.43-0.44 to 0.52-0.53 (fp8 576 B, 1 KiB rope pages, 8 per
#: item) and from 0.53 to 0.56-0.57 (bf16 576 B, 2 KiB rope pages, 4 per item); larger pages did not move.
GROUP_BYTES = 8192


def pages_mode(option: bool | None) -> str | None:
    """Which groups' loads copy whole pages: ``"all"`` that :func:`group_reason` allows, ``"auto"`` those it allows
    with ``automatic=True``, or ``None``.  ``option`` (``True``: all, ``False``: none), else
    ``HICACHE_KERNEL_PAGES`` (``1``: all, ``0``: none, unset: automatic)."""
    if option is not None:
        return "all" if option else None
    env = os.environ.get(ENV_PAGES, "").strip().lower()
    if not env:
        return "auto"
    if env in ON:
        return "all"
    if env in OFF:
        return None
    raise ConfigError(f"{ENV_PAGES}={env!r}: use 1 (page loads wherever a group allows them; or true, yes, on), "
                      "0 (off; or false, no, off) or leave it unset (automatic)", setting=ENV_PAGES)


def pages_enabled(option: bool | None) -> bool:
    """Whether some loads may copy whole pages (:func:`pages_mode` is not ``None``)."""
    return pages_mode(option) is not None


@dataclass(frozen=True)
class PagePart:
    """One host buffer's share of a group's rows, as a page load moves it: ``width`` words at word ``col`` of each
    device row, from host tables ``host`` (``host_off``, ``host_page``, ``host_tok``; per entry)."""

    width: int
    col: int
    host: dict[str, torch.Tensor]


def page_parts(g: RowGroup) -> tuple[PagePart, ...]:
    """``g``'s parts: the whole row, or (a fused group) words ``0 .. split-1`` from the ``host_*`` tables and the
    rest from the ``host_*_b`` ones."""
    names = ("host_off", "host_page", "host_tok")
    a = PagePart(g.split, 0, {k: g.tables[k] for k in names})
    if g.split == g.width:
        return (a,)
    return a, PagePart(g.width - g.split, g.split, {k: g.tables[k + "_b"] for k in names})


def strided(g: RowGroup, part: PagePart) -> bool:
    """Whether some device row of ``g`` is wider than ``part`` (the page kernel then stores row by row)."""
    return any(int(v) != part.width for v in g.tables["dev_stride"].tolist())


def group_reason(g: RowGroup, page_size: int, *, strided_ok: bool = True, automatic: bool = False) -> str | None:
    """Why ``g``'s loads cannot copy whole pages (``None``: they can): every part's host rows must be packed
    (token stride = the part's width) in pages of at least ``page_size`` rows, a page under 2**31 words (the
    kernel's in-page arithmetic is 32-bit); device rows may be wider where the kernel takes ``STRIDED``
    (``strided_ok``; a plugin's own page kernel written for packed device rows does not).  ``automatic``: also
    every part's page at least :data:`AUTO_MIN_PART_BYTES` bytes."""
    if page_size < 2:
        return "pages of one token are single rows"
    if page_size > MAX_PAGE_TOKENS:
        return f"pages of more than {MAX_PAGE_TOKENS} tokens"
    parts = page_parts(g)
    for part in parts:
        if any(int(v) != part.width for v in part.host["host_tok"].tolist()):
            return "its host token stride is not the row width (host rows are not packed)"
        if any(int(p) < page_size * part.width for p in part.host["host_page"].tolist()):
            return "its host page stride is shorter than a page of packed rows"
        if page_size * part.width >= 2**31:
            return "a page of its rows holds 2**31 words or more"
        if not strided_ok and strided(g, part):
            return "its device rows are wider than the part a host buffer holds, and the page kernel takes no STRIDED"
    if automatic:  # after every part's checks above: a group refused for its layout is never told pages=True helps
        for part in parts:
            page_bytes = page_size * part.width * g.word
            if page_bytes < AUTO_MIN_PART_BYTES:
                what = "parts (of rows split over two host buffers)" if len(parts) > 1 else "rows"
                return (f"a host page of its {part.width * g.word}-byte {what} holds {page_bytes} bytes, under the "
                        f"{AUTO_MIN_PART_BYTES} bytes automatic page loads take (the row kernel keeps more reads in "
                        "flight; pages=True or HICACHE_KERNEL_PAGES=1 takes it)")
    return None


#: Automatic page backups take a group only where its rows hold at most this many bytes and a page of them at least
#: :data:`PAGE_BACKUP_MIN_PAGE_BYTES`: what was measured ahead of the row kernel (``rowcopy_tuning.PAGE_BACKUP_TUNING``:
#: 576-, 656- and 1152-byte rows in pages of 64).  Wider rows (MHA's 2 KiB rows back up at 0.95-0.97 by rows) and
#: smaller pages were not measured: they keep the row kernel unless ``page_backups=True``.
PAGE_BACKUP_MAX_ROW_BYTES = 1152
#: See :data:`PAGE_BACKUP_MAX_ROW_BYTES` (64 rows of 576 bytes).
PAGE_BACKUP_MIN_PAGE_BYTES = 36864
#: Whether automatic page backups (the ``page_backups`` option unset) take the groups :func:`backup_reason` accepts;
#: off, only ``page_backups=True`` does.  On since the plugin kernel's page backups ran bit-exact on a GPU and matched
#: the probe kernel's figures (H100, record call 70: fp8 656 B 0.940 at -0.3% GEMM against its rows' 0.858 at +1.6%;
#: a second plugin's, record call 71: 0.937 at -1.0% against 0.814 at +0.7%).  A strategy whose page backups have not
#: been timed on a GPU keeps them opt-in (``RowKernelStrategy.auto_page_backups``).
AUTO_PAGE_BACKUPS = True


def _packed_widths(plan: HostPlan, held: Collection[str] | None = None) -> list[int]:
    """The byte widths of ``plan``'s rows that sit whole in one host segment whose token stride is the width (of the
    components in ``held`` alone, where given)."""
    parts = Counter(s.component for s in plan.segments)
    return sorted({s.width for s in plan.segments if parts[s.component] == 1 and s.addressing.token == s.width
                   and (held is None or s.component in held)})


def packed_host_rows(plan: HostPlan) -> bool:
    """Whether any row of ``plan`` sits in one host segment whose token stride is its width (rows packed: a layer's
    page then one run of words, as :func:`backup_reason` asks of the bound group; token-major layouts of more than
    one layer have none)."""
    return bool(_packed_widths(plan))


def automatic_backup_fit(plan: HostPlan, page_size: int, held: Collection[str] | None = None) -> str:
    """Which of ``plan``'s packed host rows, in pages of ``page_size`` tokens, automatic page backups take (rows of at
    most :data:`PAGE_BACKUP_MAX_ROW_BYTES`, pages of 2 .. :data:`MAX_PAGE_TOKENS` tokens and of at least
    :data:`PAGE_BACKUP_MIN_PAGE_BYTES`, as :func:`backup_reason` asks): a clause for ``hicache explain``, e.g.
    ``"here: rows of 656 B (pages of 41 KiB)"`` or ``"here: none (rows of 2048 B in pages of 128 KiB)"``.  ``held``:
    the components with a layer on this rank (``None``: every one; a component of other layers moves nothing here).
    Device rows must be packed too; the pool checks that when it binds them."""
    if page_size < 2:
        return "here: none (pages of one token are single rows)"
    if page_size > MAX_PAGE_TOKENS:
        return f"here: none (pages of more than {MAX_PAGE_TOKENS} tokens)"
    widths = _packed_widths(plan, held)
    if not widths:
        return "here: none (no packed host rows)"
    taken = [w for w in widths if w <= PAGE_BACKUP_MAX_ROW_BYTES and page_size * w >= PAGE_BACKUP_MIN_PAGE_BYTES]

    def rows(ws: list[int]) -> tuple[str, str]:
        return ", ".join(map(str, ws)), ", ".join(f"{page_size * w / 1024:g}" for w in ws)
    if taken:
        return "here: rows of {} B (pages of {} KiB)".format(*rows(taken))
    return "here: none (rows of {} B in pages of {} KiB)".format(*rows(widths))


def backup_reason(g: RowGroup, page_size: int, *, automatic: bool = False) -> str | None:
    """Why ``g``'s backups cannot copy whole pages as flat words (``None``: they can): pages of 2 ..
    :data:`MAX_PAGE_TOKENS` tokens, the row in one host buffer, host rows and device rows packed (token strides of
    the row width: a page is then one run of words on both sides), a page under 2**31 words.  ``automatic``: also
    :data:`AUTO_PAGE_BACKUPS` on, rows of at most :data:`PAGE_BACKUP_MAX_ROW_BYTES` and pages of at least
    :data:`PAGE_BACKUP_MIN_PAGE_BYTES`."""
    if page_size < 2:
        return "pages of one token are single rows"
    if page_size > MAX_PAGE_TOKENS:
        return f"pages of more than {MAX_PAGE_TOKENS} tokens"
    if g.split != g.width:
        return "its rows are split over two host buffers"
    if any(int(v) != g.width for v in g.tables["host_tok"].tolist()):
        return "its host token stride is not the row width (host rows are not packed)"
    if any(int(v) != g.width for v in g.tables["dev_stride"].tolist()):
        return "its device token stride is not the row width (device rows are not packed)"
    if page_size * g.width >= 2**31:
        return "a page of its rows holds 2**31 words or more"
    if automatic:
        if not AUTO_PAGE_BACKUPS:
            return "automatic page backups are off (rowcopy_pages.AUTO_PAGE_BACKUPS; page_backups=True takes them)"
        row, page = g.width * g.word, page_size * g.width * g.word
        if row > PAGE_BACKUP_MAX_ROW_BYTES or page < PAGE_BACKUP_MIN_PAGE_BYTES:
            return (f"its {row}-byte rows in pages of {page} bytes are outside what automatic page backups take "
                    f"(rows of <= {PAGE_BACKUP_MAX_ROW_BYTES} bytes in pages of >= {PAGE_BACKUP_MIN_PAGE_BYTES}; "
                    "page_backups=True takes them)")
    return None


def _pow2_floor(x: int) -> int:
    return 1 << (x.bit_length() - 1)


def pieces(page_words: int, max_part: int, vec: int) -> tuple[int, int, int, int, int, int]:
    """``(PART, PARTS, R1, R2, R3, R4)`` for pages of ``page_words`` words, parts of at most ``max_part``.

    ``PART`` is a power of two, at least ``vec`` (a power of two dividing ``page_words``: every piece then
    starts on a ``vec``-word boundary), ``PARTS * PART <= page_words``; the rest is ``R1 + R2 + R3`` (its
    three highest powers of two, 0 where absent) plus ``R4``, the next power of two (at least ``vec``) of
    whatever is still left (0: nothing), masked to the page by the kernel.
    """
    if page_words < 1 or max_part < 1 or vec < 1 or vec & (vec - 1) or page_words % vec:
        raise ValueError(f"page_words and max_part must be positive and vec a power of two dividing page_words, "
                         f"got {page_words}, {max_part}, {vec}")
    part = max(vec, min(_pow2_floor(page_words), _pow2_floor(max_part)))
    parts, rest = divmod(page_words, part)
    rs = []
    for _ in range(3):
        r = _pow2_floor(rest) if rest else 0
        rs.append(r)
        rest -= r
    r4 = max(vec, 1 << (rest - 1).bit_length()) if rest else 0
    return part, parts, rs[0], rs[1], rs[2], r4


def group_pages(page_words: int, word: int, page_tokens: int, tile_bytes: int) -> int:
    """Pages per work item of the page kernel (its ``GROUP``) for pages of ``page_words`` words of ``word`` bytes,
    ``page_tokens`` index positions (a power of two) checked per page: 1 where a page, its words padded to a power
    of two, holds more than half of ``min(GROUP_BYTES, tile_bytes)``; else the most pages (a power of two) whose
    padded words fit in that, and whose index checks stay within :data:`MAX_PAGE_TOKENS` positions (1 while
    ``GROUP_BYTES`` is 0)."""
    if page_words < 1 or word < 1 or page_tokens < 1 or tile_bytes < 1:
        raise ValueError(f"page_words, word, page_tokens and tile_bytes must be positive, got {page_words}, {word}, "
                         f"{page_tokens}, {tile_bytes}")
    padded = (1 << (page_words - 1).bit_length()) * word
    fit = min(GROUP_BYTES, tile_bytes) // padded
    return max(1, min(_pow2_floor(fit) if fit else 1, _pow2_floor(max(1, MAX_PAGE_TOKENS // page_tokens))))


def launch_pieces(page_words: int, word: int, vec: int, page_tokens: int, tile_bytes: int,
                  grouping: bool = True) -> tuple[int, int, int, int, int, int, int]:
    """``(GROUP, PART, PARTS, R1, R2, R3, R4)`` of a page load of pages of ``page_words`` words: several small pages
    per work item (:func:`group_pages`; ``grouping``: the kernel declares ``GROUP``), each read as one power of two
    of words masked to the page; else one page per item, in the :func:`pieces` of parts of at most ``tile_bytes``."""
    group = group_pages(page_words, word, page_tokens, tile_bytes) if grouping else 1
    if group > 1:
        return group, 1 << (page_words - 1).bit_length(), 1, 0, 0, 0, 0
    return (1, *pieces(page_words, max(1, tile_bytes // word), vec))
