"""The run-directory layout (``parity exec --out RUN_DIR``), in one place (docs/artifacts.md).

    RUN_DIR/run.json                   the command, its exit code and status (parity exec)
    RUN_DIR/rank-NNNNN/meta.json       one folder per global rank: meta, hashes, steps, buckets
    RUN_DIR/rank-NNNNN/steps.jsonl     one line per recorded step (line 0 is step 0)
    RUN_DIR/rank-NNNNN/hashes.bin      per-parameter hashes, raw (schema 1: hashes.jsonl)
    RUN_DIR/nodes/node-K/...           a multi-node job's per-node output before the merge
    RUN_DIR/ops/rank-NNNNN.jsonl       op records of one step (a `parity bisect` rerun only)

The writer (artifacts.RankWriter), the reader (artifacts.read_run), ``parity exec``
(capture/launch.py), the multi-node launcher, the sweep runner and the HTML report all ask this
module for names and paths instead of spelling them. Standard library only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RUN_FILE = "run.json"
META_FILE = "meta.json"
PARAMS_FILE = "params.json"
HASHES_FILE = "hashes.bin"
HASHES_V1_FILE = "hashes.jsonl"  # schema 1 (hex in JSON lines): still read, no longer written
STEPS_FILE = "steps.jsonl"
BUCKETS_FILE = "buckets.jsonl"
# every file a rank folder may hold (a new capture of the rank removes them first)
RANK_FILES = (META_FILE, PARAMS_FILE, STEPS_FILE, HASHES_FILE, HASHES_V1_FILE, BUCKETS_FILE)
NODES_DIR = "nodes"
RANK_DIR = "rank-{:05d}"
_RANK_DIR_RE = re.compile(r"^rank-(\d{5})$")


def rank_dir(out_dir: str | os.PathLike, rank: int) -> Path:
    """``out_dir/rank-NNNNN``."""
    return Path(out_dir) / RANK_DIR.format(rank)


def rank_of(name: str) -> int | None:
    """The rank a folder name stands for (``rank-00003`` -> 3), None if it is no rank folder."""
    m = _RANK_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def rank_dirs(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(rank, folder) for every rank folder in ``out_dir``, by name; raises OSError if
    ``out_dir`` cannot be listed."""
    out = []
    for child in sorted(Path(out_dir).iterdir()):
        r = rank_of(child.name)
        if r is not None and child.is_dir():
            out.append((r, child))
    return out


def looks_like_run(path: str | os.PathLike) -> bool:
    """Does ``path`` hold a run (a run.json or a rank folder)? For hints, not for reading."""
    p = Path(path)
    try:
        return (p / RUN_FILE).is_file() or bool(rank_dirs(p))
    except OSError:
        return False


def count_steps(rank_folder: str | os.PathLike) -> int:
    """Lines in a rank's steps.jsonl (0 when absent): cheap, for progress and summaries."""
    try:
        with open(Path(rank_folder) / STEPS_FILE, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def node_out_dir(run_dir: str | os.PathLike, node: int | str, nnodes: int) -> Path:
    """Where node ``node``'s ``parity exec`` writes (``RUN_DIR`` itself for a one-node job)."""
    run_dir = Path(run_dir)
    return run_dir if nnodes == 1 else run_dir / NODES_DIR / f"node-{node}"


def live_rank_dir(run_dir: str | os.PathLike, rank: int) -> Path | None:
    """Where rank ``rank`` is writing now: ``RUN_DIR/rank-NNNNN``, or before the merge of a
    multi-node job, ``RUN_DIR/nodes/node-K/rank-NNNNN`` (for progress displays)."""
    name = RANK_DIR.format(rank)
    run_dir = Path(run_dir)
    if (run_dir / name).is_dir():
        return run_dir / name
    return next(iter(sorted(run_dir.glob(f"{NODES_DIR}/node-*/{name}"))), None)


CLAIM_FILE = "claim.json"  # rank-NNNNN/claim.json: the process recording this rank (capture/claims.py)
REFUSED_PREFIX = "refused-"  # rank-NNNNN/refused-<pid>.json: a process that claimed it too


def refused_records(rank_folder: str | os.PathLike) -> list[dict]:
    """The ``refused-<pid>.json`` records of a rank folder: processes that also claimed this
    rank and were not recorded (capture/claims.py)."""
    import json

    out = []
    try:  # names, not Path objects: a diff lists 512 rank folders for what is usually nothing
        names = sorted(n for n in os.listdir(rank_folder)
                       if n.startswith(REFUSED_PREFIX) and n.endswith(".json"))
    except OSError:
        return []
    for p in (Path(rank_folder) / n for n in names):
        try:
            obj = json.loads(p.read_text())
        except (OSError, ValueError):
            obj = {"reason": f"{p.name}: unreadable"}
        if isinstance(obj, dict):
            out.append(obj)
    return out


OPS_DIR = "ops"  # RUN_DIR/ops/rank-NNNNN.jsonl: capture/ops.py writes, bisect.py reads
_OPS_FILE_RE = re.compile(r"^rank-(\d{5})\.jsonl$")


def ops_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """``RUN_DIR/ops/rank-NNNNN.jsonl``: one rank's op records (a meta line, then one per op)."""
    return Path(run_dir) / OPS_DIR / f"rank-{rank:05d}.jsonl"


def ops_ranks(run_dir: str | os.PathLike) -> list[int]:
    """The ranks with an ops file in ``run_dir``, sorted ([] when there is none)."""
    try:
        names = [p.name for p in (Path(run_dir) / OPS_DIR).iterdir()]
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_OPS_FILE_RE.match, names) if m)


def read_ops(run_dir: str | os.PathLike, rank: int) -> tuple[dict, list[dict]] | None:
    """(meta, records) of one rank's ops file, None when it is missing or unreadable."""
    import json

    try:
        lines = ops_path(run_dir, rank).read_text().splitlines()
        meta = json.loads(lines[0]).get("meta") or {}
        return meta, [json.loads(x) for x in lines[1:] if x.strip()]
    except (OSError, ValueError, IndexError, AttributeError):
        return None
