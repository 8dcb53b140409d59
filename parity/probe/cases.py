"""What the probe runs: the case matrix, the size ladder, ``--sizes-from RUN``, and the inputs.

A case is one collective (``reduce_scatter`` or ``all_reduce``), one op (``sum``, or ``avg``:
NCCL's PreMulSum for floats), one dtype (``float32``, ``bfloat16``) and one size. The ladder
(``--sizes 1K-256M``: every power of two in the range; or a list ``1K,48K,1M``) gives the size
of each rank's input buffer; ``--sizes-from RUN`` adds the exact reduce-scatter and all-reduce
buckets a recorded run issued (its own dtype, both ops), so a probe answers for the buckets a
training job really has.

Inputs are seeded and regenerable in pieces: element ``i`` of rank ``s``'s input depends only on
(seed, s, i) (blocks of :data:`BLOCK` elements, each from its own ``torch.Generator``), so a rank
can rebuild the other ranks' values of the elements it checks without anyone sending them. The
values are ``sign * (1 + u) * 2**e`` with ``e`` uniform in [-4, 4] and random signs: with that
spread a change of summation order changes the most sums (measured on 200,000 elements: at 4
ranks a rotated order changes 36% of fp32 and 37% of bf16 sums, at 16 ranks a reversed order
72% and 74%; a spread of +-24 binades changes 16% and 4% at 4 ranks), so a wrong channel
boundary or ring shows within a few elements. torch's CPU generator is used everywhere: the same
seed gives the same values on every machine (a CUDA generator's output depends on the GPU's
launch configuration).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import asdict, dataclass

from parity.errors import ParityError

REDUCE_SCATTER, ALL_REDUCE = "reduce_scatter", "all_reduce"
COLLECTIVES = (REDUCE_SCATTER, ALL_REDUCE)
OPS = ("sum", "avg")
DTYPES = {"float32": 4, "bfloat16": 2}
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "f32": "float32", "float": "float32",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
DEFAULT_SIZES = "1K-256M"
BLOCK = 1 << 18  # elements per generator block
EXPONENT_SPREAD = 4  # e in [-4, 4]
MAX_BYTES = 1 << 34

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True)
class Case:
    """One collective call of the probe (run ``--repeat`` times).

    Attributes:
        index: its position in the probe's order (the order the report and "first" use).
        collective: REDUCE_SCATTER or ALL_REDUCE.
        op: "sum" or "avg".
        dtype: "float32" or "bfloat16".
        count: elements of each rank's output for a reduce-scatter (``predict``'s count), of
            the buffer for an all-reduce.
        origin: "ladder", or the recorded bucket it reproduces ("run: reduce_scatter #3").
    """

    index: int
    collective: str
    op: str
    dtype: str
    count: int
    origin: str = "ladder"

    @property
    def elem_size(self) -> int:
        return DTYPES[self.dtype]

    def input_count(self, world: int) -> int:
        """Elements of each rank's input buffer."""
        return self.count * (world if self.collective == REDUCE_SCATTER else 1)

    def input_bytes(self, world: int) -> int:
        return self.input_count(world) * self.elem_size

    def label(self, world: int) -> str:
        return (f"{self.collective} {self.op} {SHORT[self.dtype]} "
                f"{human_bytes(self.input_bytes(world))}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        return cls(int(d["index"]), str(d["collective"]), str(d["op"]), str(d["dtype"]),
                   int(d["count"]), str(d.get("origin", "ladder")))


def human_bytes(n: int) -> str:
    """1024 -> '1 KiB', 1536 -> '1.5 KiB', 100 -> '100 B'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n} B"


def parse_size(text: str, what: str = "--sizes") -> int:
    m = _SIZE.match(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ParityError(f"{what}: {text!r} is not a size (e.g. 1K, 256M, 3145728)")
    n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if not 1 <= n <= MAX_BYTES:
        raise ParityError(f"{what}: {text!r} must be 1 B .. 16 GiB")
    return n


def parse_sizes(text: str) -> list[int]:
    """``1K-256M`` (every power of two from 1K to 256M), ``1K,48K,1M``, or both mixed
    (``1K-64K,3M``) -> sorted distinct byte counts."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        lo_text, dash, hi_text = part.partition("-")
        if not dash:
            out.add(parse_size(part))
            continue
        lo, hi = parse_size(lo_text), parse_size(hi_text)
        if lo > hi:
            raise ParityError(f"--sizes: {part!r}: the range runs low-high")
        p = 1 << (lo - 1).bit_length()  # the first power of two >= lo
        if lo != p:
            out.add(lo)
        while p <= hi:
            out.add(p)
            p <<= 1
        out.add(hi)
    if not out:
        raise ParityError("--sizes: no size given (e.g. 1K-256M)")
    return sorted(out)


def parse_choice(text: str, allowed, what: str, aliases: dict | None = None) -> list[str]:
    """A comma list of ``allowed`` names (``aliases`` maps spellings), order kept."""
    out = []
    for part in filter(None, (p.strip().lower() for p in str(text).split(","))):
        name = (aliases or {}).get(part, part)
        if name not in allowed:
            raise ParityError(f"{what}: {part!r} is not one of {', '.join(allowed)}")
        if name not in out:
            out.append(name)
    if not out:
        raise ParityError(f"{what}: empty")
    return out


def ladder_count(collective: str, nbytes: int, elem_size: int, world: int) -> int:
    """The case count for an input of ``nbytes`` per rank (at least one element per rank)."""
    elems = max(1, nbytes // elem_size)
    if collective == REDUCE_SCATTER:
        return max(1, elems // world)
    return elems


def build_cases(sizes: list[int], world: int, collectives=COLLECTIVES, ops=OPS,
                dtypes=tuple(DTYPES), recorded: list[tuple[str, str, int, str]] = ()
                ) -> list[Case]:
    """Every case, smallest input first, then collective, dtype, op (the probe's order).
    ``recorded``: (collective, dtype, count, origin) of a run's buckets (:func:`sizes_from_run`),
    run with both ops. Cases that come out equal are kept once."""
    raw = []
    for nbytes in sizes:
        for coll in collectives:
            for dt in dtypes:
                raw.append((coll, dt, ladder_count(coll, nbytes, DTYPES[dt], world), "ladder"))
    raw.extend(recorded)
    rank_of = {c: i for i, c in enumerate(COLLECTIVES)}
    raw.sort(key=lambda r: (r[2] * DTYPES[r[1]] * (world if r[0] == REDUCE_SCATTER else 1),
                            rank_of[r[0]], list(DTYPES).index(r[1]), r[3] != "ladder"))
    seen, cases = set(), []
    for coll, dt, count, origin in raw:
        for op in ops:
            key = (coll, op, dt, count)
            if key in seen:
                continue
            seen.add(key)
            cases.append(Case(len(cases), coll, op, dt, count, origin))
    return cases


def sizes_from_run(run_dir: str, world: int) -> tuple[list[tuple[str, str, int, str]], list[str]]:
    """The reduce-scatter and all-reduce buckets of a recorded run (``parity exec --out``), as
    (collective, dtype, count, origin) at ``world`` ranks, and notes on what was left out.

    A reduce-scatter bucket recorded at another world size is re-derived at ``world`` the way
    ``parity diff --at`` does (FSDP2 dim-0 shards, parity.diff.reduction.derive_layout); one the
    derivation cannot reproduce is left out and named."""
    from parity.artifacts import read_run
    from parity.diff.buckets import A_PREFERS, select_layout
    from parity.diff.reduction import derive_layout, shapes_of

    try:
        run = read_run(run_dir)
    except ParityError as e:
        raise ParityError(f"--sizes-from {run_dir}: {e}") from None
    if not run.ranks:
        raise ParityError(f"--sizes-from {run_dir}: no rank folders (not a parity run?)")
    rank = min(r for r in run.ranks)
    rd = run.ranks[rank]
    recorded_world = run.world_size
    layout = select_layout(rd.buckets, A_PREFERS, rank)
    shapes = shapes_of(rd.params)
    out, notes, seen = [], [], set()
    for coll in COLLECTIVES:
        for b in layout.buckets.get(coll, []):
            dtype = DTYPE_ALIASES.get(str(b.dtype or "").lower())
            origin = f"run: {coll} bucket #{b.index}"
            if dtype is None:
                notes.append(f"{origin}: dtype {b.dtype} not probed (float32, bfloat16 are)")
                continue
            es = DTYPES[dtype]
            if coll == ALL_REDUCE or recorded_world == world:
                count = (b.total_bytes or 0) // es
            else:
                derived = derive_layout(b, shapes, world, recorded_world)
                if isinstance(derived, str):
                    notes.append(f"{origin}: not re-derived at {world} ranks: {derived}")
                    continue
                count = derived[1]
            if count <= 0:
                notes.append(f"{origin}: empty")
                continue
            if (coll, dtype, count) not in seen:
                seen.add((coll, dtype, count))
                out.append((coll, dtype, count, origin))
    if not out and not notes:
        notes.append(f"--sizes-from {run_dir}: the run recorded no reduce-scatter or all-reduce "
                     "bucket")
    return out, notes


# ---------------------------------------------------------------------------------- inputs


def _block_seed(seed: int, rank: int, block: int) -> int:
    h = hashlib.blake2b(f"parity-nccl-probe:{seed}:{rank}:{block}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


@functools.lru_cache(maxsize=32)
def _block(seed: int, rank: int, block: int):
    """One block of rank ``rank``'s stream (cached: every case reads the same first blocks;
    callers copy what they take)."""
    import torch

    g = torch.Generator().manual_seed(_block_seed(seed, rank, block))
    u = torch.rand(BLOCK, generator=g, dtype=torch.float32)
    e = torch.randint(-EXPONENT_SPREAD, EXPONENT_SPREAD + 1, (BLOCK,), generator=g,
                      dtype=torch.int32)
    sign = torch.randint(0, 2, (BLOCK,), generator=g, dtype=torch.int32) * 2 - 1
    return torch.ldexp(1.0 + u, e.to(torch.float32)) * sign.to(torch.float32)


def values(seed: int, rank: int, lo: int, hi: int, dtype: str):
    """Elements [lo, hi) of rank ``rank``'s input stream, as a CPU tensor of ``dtype``. Every
    case's input is a prefix of this stream (the reduce-scatter's row d is its elements
    [d * count, (d + 1) * count))."""
    import torch

    tdt = getattr(torch, dtype)
    if hi <= lo:
        return torch.empty(0, dtype=tdt)
    parts = []
    for b in range(lo // BLOCK, (hi - 1) // BLOCK + 1):
        a, z = max(lo, b * BLOCK) - b * BLOCK, min(hi, (b + 1) * BLOCK) - b * BLOCK
        parts.append(_block(seed, rank, b)[a:z])
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.to(tdt, copy=True)  # never a view of the cached block (all-reduce is in place)
