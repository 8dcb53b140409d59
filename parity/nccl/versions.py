"""NCCL releases and the rule family each one follows (what changes a reduction's sum order).

Why: the channel split, the ring duplication and the log formats changed between releases, so a
prediction is only as good as the release it models. Every rule below was read from the
NVIDIA/nccl sources at the release tags v2.20.5-1 ... v2.30.7-1 (``git show TAG:path``); a
release outside 2.20-2.30 gets no rules (``rules_for`` returns None) and every prediction for it
is ``unknown``.

What differs between releases (file, function, first tag that has it):

* Channel split of a collective (``src/enqueue.cc``):
  - 2.20-2.21 ``addCBDCollToPlan``: bytes per channel ``DIVUP(DIVUP(bytes, usableChannels), 16)
    * 16``, each channel's count rounded up to ``computeCollAlignCount`` (Simple 4096 B, LL 8 B
    x threads, LL128 480 B x warps);
  - 2.22 ``scheduleCollTasksToPlan``: 16 B cells, ``MinTrafficPerChannel = 512``, the first
    channel's cells rounded down;
  - 2.23-2.28: cells of ``MinTrafficPerChannel = 16 << 10`` traffic (``divUp(divUp(16K,
    trafficPerByte), 16) * 16`` bytes), traffic per channel ``max(16K, traffic / nChannels)``;
    from 2.26 LL counts 4x the traffic (``ncclPrepareTasks``: ``trafficBytes *= 4``;
    ``scheduleCollTasksToPlan``: ``trafficPerByte *= 4``);
  - 2.29-2.30: ``MinTrafficPerChannel = 32 << 10`` and ``divUp(traffic / nChannels, 16) * 16``.
* ``MAXCHANNELS`` (``src/include/device.h``): 32 up to 2.24, 64 from 2.25.
* Odd-node ring swap, "Alternate rings to avoid crossing rails" (``ncclTopoPostset``,
  ``src/graph/connect.cc``): 2.20 when the ring graph has crossNic, an even node count and an
  even channel count; 2.21-2.25 crossNic and even channels; 2.26-2.27 ``crossNic == 2``; 2.28+
  decided per rank (``allTopoRanks[r]->crossNicRing == 2``).
* One more channel duplication on multi-node Hopper, "Use 4 compute channels per search channel"
  (``ncclTopoPostset``): ``minCompCap == 90`` up to 2.24, ``>= 90`` (Blackwell too) from 2.25.
* PAT (``src/graph/tuning.cc`` ``ncclPatEnable``): from 2.23.
* Ring lines (``dumpLine``, ``src/graph/rings.cc``): up to 2.22 at most 20 ranks, no marker;
  from 2.23 cut at 128 characters and ended by ``...``.
* TUNING lines: 2.20-2.22 ``N Bytes -> Algo i proto j time t`` (``topoGetAlgoInfo``; N = the
  whole input); 2.23 ``Func: N Bytes -> Algo i proto j time t``; from 2.24 ``Func: N Bytes ->
  Algo NAME proto NAME channel{Lo..Hi}={a..b}`` (``scheduleCollTasksToPlan``; N =
  ``task->count * typeSize``, per rank for ReduceScatter/AllGather).

Unchanged from 2.20 to 2.30 (and modelled once, in ``channels`` and ``chunking``): the channel
cut of ``topoGetAlgoInfo``/``getChannnelThreadInfo``, the thread thresholds and counts, the Ring
all-reduce chunk sizes and the ``ring->index`` owner rule, the device loops of
``src/device/reduce_scatter.h`` and ``all_reduce.h``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST, NEWEST = "2.20", "2.30"

# split families (the four of issue 30)
SPLIT_EVEN, SPLIT_CELL16, SPLIT_MIN16K, SPLIT_MIN32K = "even", "cell16", "min16k", "min32k"


@dataclass(frozen=True)
class Rules:
    """The rules of one NCCL minor release (see the module docstring for where each was read).

    Attributes:
        version: the minor release, e.g. "2.27".
        family: the split family's name, e.g. "2.23-2.28" (what ``MODEL`` prints).
        split: SPLIT_EVEN | SPLIT_CELL16 | SPLIT_MIN16K | SPLIT_MIN32K.
        min_traffic: ``MinTrafficPerChannel`` in bytes (unused by SPLIT_EVEN).
        ll_traffic_x4: LL counts 4x traffic in the split (2.26+).
        max_channels: ``MAXCHANNELS``.
        odd_swap: "even-nodes" (2.20), "crossnic" (2.21-2.25), "crossnic2" (2.26-2.27),
            "per-rank" (2.28+): when odd nodes exchange rings c and c^1.
        sm90_dup: "==90" or ">=90": which compute capability gets the extra multi-node
            duplication.
        pat: the PAT algorithm exists.
        ring_line: "20-ranks" or "128-chars": how rank 0's ring lines are cut.
        tuning_format: "2.20" | "2.23" | "2.24" (see the module docstring).
    """

    version: str
    family: str
    split: str
    min_traffic: int
    ll_traffic_x4: bool
    max_channels: int
    odd_swap: str
    sm90_dup: str
    pat: bool
    ring_line: str
    tuning_format: str


def _rules(minor: int) -> Rules:
    v = f"2.{minor}"
    if minor <= 21:
        split, family, mt = SPLIT_EVEN, "2.20-2.21", 0
    elif minor == 22:
        split, family, mt = SPLIT_CELL16, "2.22", 512
    elif minor <= 28:
        split, family, mt = SPLIT_MIN16K, "2.23-2.28", 16 << 10
    else:
        split, family, mt = SPLIT_MIN32K, "2.29-2.30", 32 << 10
    odd = ("even-nodes" if minor == 20 else "crossnic" if minor <= 25
           else "crossnic2" if minor <= 27 else "per-rank")
    return Rules(
        version=v, family=family, split=split, min_traffic=mt,
        ll_traffic_x4=minor >= 26, max_channels=32 if minor <= 24 else 64, odd_swap=odd,
        sm90_dup="==90" if minor <= 24 else ">=90", pat=minor >= 23,
        ring_line="20-ranks" if minor <= 22 else "128-chars",
        tuning_format="2.20" if minor <= 22 else "2.23" if minor == 23 else "2.24")


RULES = {f"2.{m}": _rules(m) for m in range(20, 31)}
_VERSION = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-+.][\w.+-]*)?\s*$")


def parse_version(text: str) -> tuple[int, int, int | None] | None:
    """``"2.27.5-1"``, ``"2.27.5+cuda12.4"``, ``"2.27"`` -> (2, 27, 5) / (2, 27, None); None if
    the text is not a version."""
    m = _VERSION.match(str(text))
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), (int(m.group(3)) if m.group(3) else None)


def minor_of(text: str) -> str | None:
    """``"2.27.5-1"`` -> ``"2.27"`` (None if not a version)."""
    v = parse_version(text)
    return None if v is None else f"{v[0]}.{v[1]}"


def rules_for(version: str | None) -> Rules | None:
    """The rules of ``version`` (any spelling ``parse_version`` reads; None = the newest); None
    when the release is outside the modelled families (2.20-2.30)."""
    if version is None:
        return RULES[NEWEST]
    return RULES.get(minor_of(version) or "")
