"""The on-disk artifact schema: the one writer capture uses and the one reader everything else uses.

docs/artifacts.md describes the layout; this module (with rundir.py, the folder and file names)
is its only implementation. The writer runs
inside training processes, so it is small and does no work beyond formatting and appending lines.
The reader is tolerant: a truncated last line, a corrupted line or a missing rank is reported in
``problems`` and skipped, never raised, so a killed job still yields everything it finished.
"""

from __future__ import annotations

import binascii
import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from parity.errors import ArtifactError
from parity.rundir import (BUCKETS_FILE, HASHES_FILE, META_FILE, RUN_FILE, STEPS_FILE,
                           rank_dir, rank_of, refused_records)

SCHEMA_VERSION = 1
HASH_BYTES = 16  # xxh3-128
NO_HASH = b"\0" * HASH_BYTES  # a parameter with no gradient at that step



def write_text_atomic(path: str | os.PathLike, data: str) -> None:
    """Write text to a temporary file beside ``path`` and rename it into place: a reader sees
    the old file or the new one, never half of one; a full disk leaves the old file intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise ArtifactError(f"cannot write {path}: {e.strerror or e}") from None


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    """Write JSON atomically (see write_text_atomic).

    ``indent=None`` for large objects: an indent makes ``json`` use its pure-Python encoder
    (~10x slower; 70 ms for a 1,500-parameter table).
    """
    try:
        text = json.dumps(obj, indent=indent, sort_keys=False, allow_nan=False)
    except ValueError:  # NaN or infinity somewhere (a NaN loss): not JSON; write null instead
        text = json.dumps(finite_json(obj), indent=indent, sort_keys=False, allow_nan=False)
    write_text_atomic(path, text + "\n")


def finite_json(obj):
    """``obj`` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def rollup_digest(raw_hashes: bytes) -> str:
    """The roll-up of one step's per-parameter hashes (compared before any per-parameter work)."""
    return xxhash.xxh3_128_hexdigest(raw_hashes)


class _LineFile:
    """An append-only JSON-lines file: each record is one ``write`` of a complete line."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "ab", buffering=0)
        self.offset = self._f.seek(0, os.SEEK_END)

    def append(self, record: dict) -> int:
        """Append one record; return the byte offset at which its line starts."""
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        start = self.offset
        try:
            n = self._f.write(line)
        except OSError as e:
            raise ArtifactError(f"cannot write {self.path}: {e.strerror or e}") from None
        if n != len(line):
            raise ArtifactError(f"cannot write {self.path}: short write ({n} of {len(line)} bytes)")
        self.offset += n
        return start

    def close(self) -> None:
        self._f.close()


class RankWriter:
    """Writes one rank's artifacts incrementally (see docs/artifacts.md)."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, meta: dict):
        self.dir = rank_dir(out_dir, rank)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"cannot create {self.dir}: {e.strerror or e}") from None
        self.meta = {"v": SCHEMA_VERSION, "rank": rank, **meta}
        self.meta.setdefault("started", time.time())
        self.meta.setdefault("ended", None)
        self.meta.setdefault("status", "running")
        self.meta.setdefault("error", None)
        write_json_atomic(self.dir / META_FILE, self.meta)
        self._hashes = _LineFile(self.dir / HASHES_FILE)
        self._steps = _LineFile(self.dir / STEPS_FILE)
        self._buckets = _LineFile(self.dir / BUCKETS_FILE)

    def update_meta(self, **updates) -> None:
        self.meta.update(updates)
        write_json_atomic(self.dir / META_FILE, self.meta)

    def write_params(self, params: list[dict]) -> None:
        """The parameter table, in the order every later hash line uses."""
        table = [{"index": i, **p} for i, p in enumerate(params)]
        write_json_atomic(self.dir / "params.json", {"v": SCHEMA_VERSION, "params": table},
                          indent=None)

    def _hash_line(self, step: int, kind: str, raw: bytes) -> tuple[int, str]:
        digest = rollup_digest(raw)
        offset = self._hashes.append(
            {"v": SCHEMA_VERSION, "step": step, "kind": kind, "n": len(raw) // HASH_BYTES,
             "digest": digest, "hashes": raw.hex()}
        )
        return offset, digest

    def write_step(self, step: int, param_hashes: bytes, grad_hashes: bytes | None = None,
                   loss: float | None = None, loss_hash: str | None = None) -> None:
        """Record one step: ``*_hashes`` are the raw 16-byte hashes concatenated in table order."""
        p_off, p_digest = self._hash_line(step, "param", param_hashes)
        g_off = g_digest = None
        if grad_hashes is not None:
            g_off, g_digest = self._hash_line(step, "grad", grad_hashes)
        self._steps.append(
            {"v": SCHEMA_VERSION, "step": step, "param_digest": p_digest, "grad_digest": g_digest,
             "loss": loss, "loss_hash": loss_hash, "param_offset": p_off, "grad_offset": g_off,
             "time": time.time()}
        )

    def write_bucket(self, bucket: dict) -> None:
        self._buckets.append({"v": SCHEMA_VERSION, **bucket})

    def close(self, status: str = "ok", error: str | None = None) -> None:
        for f in (self._hashes, self._steps, self._buckets):
            f.close()
        self.update_meta(status=status, error=error, ended=time.time())


# --------------------------------------------------------------------------------------- reader


def _read_lines(path: Path, problems: list[str], required: tuple[str, ...],
                shared: dict[bytes, list[dict]] | None = None, check=None) -> list[dict]:
    """Every valid record of a JSON-lines file; what is not valid goes to ``problems``.

    With ``shared``, a file whose bytes equal an earlier clean file's returns that file's list
    (the same object: ranks usually write identical bucket manifests).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        problems.append(f"{path}: missing")
        return []
    except OSError as e:
        problems.append(f"{path}: unreadable ({e.strerror or e})")
        return []
    if shared is not None:
        hit = shared.get(data)
        if hit is not None:
            return hit
    n_problems = len(problems)
    records = []
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        problems.append(f"{path}: last line truncated ({len(lines[-1])} bytes), ignored")
    for lineno, line in enumerate(lines[:-1], 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            problems.append(f"{path}:{lineno}: not JSON, skipped")
            continue
        if not isinstance(rec, dict) or rec.get("v") != SCHEMA_VERSION or any(
            k not in rec for k in required
        ) or (check is not None and not check(rec)):
            problems.append(f"{path}:{lineno}: not a schema-{SCHEMA_VERSION} record, skipped")
            continue
        records.append(rec)
    if shared is not None and len(problems) == n_problems:
        shared[data] = records
    return records


def _read_json(path: Path, problems: list[str]) -> dict | None:
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        problems.append(f"{path}: missing")
        return None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        problems.append(f"{path}: unreadable ({e.__class__.__name__})")
        return None
    if not isinstance(obj, dict) or obj.get("v") != SCHEMA_VERSION:
        problems.append(f"{path}: not a schema-{SCHEMA_VERSION} file")
        return None
    return obj


@dataclass
class RankData:
    """One rank's artifacts. Per-parameter hashes are read lazily, by offset, only when asked.

    ``buckets`` may be the very list of another rank of the same run when both ranks'
    buckets.jsonl are byte-identical (the usual case): treat it as read-only.
    """

    rank: int
    path: Path
    meta: dict
    params: list[dict]
    steps: dict[int, dict]
    buckets: list[dict]
    problems: list[str] = field(default_factory=list)
    # processes that also claimed this rank and were not recorded (rundir.refused_records)
    refused: list[dict] = field(default_factory=list)

    @property
    def fqns(self) -> list[str]:
        return [p["fqn"] for p in self.params]

    def hashes(self, step: int, kind: str = "param") -> np.ndarray | None:
        """Per-parameter hashes of one step as an (n, 16) uint8 array, or None if absent/bad."""
        rec = self.steps.get(step)
        if rec is None:
            return None
        offset = rec.get("param_offset" if kind == "param" else "grad_offset")
        if not isinstance(offset, int):
            return None
        try:
            line = self._read_line(offset)
            hrec, raw = _parse_hash_line(line)
        except (OSError, ValueError, KeyError, TypeError):
            self.problems.append(f"{self.path / HASHES_FILE}: step {step} {kind} line unreadable")
            return None
        if hrec.get("step") != step or hrec.get("kind") != kind or len(raw) % HASH_BYTES:
            self.problems.append(f"{self.path / HASHES_FILE}: step {step} {kind} line mismatched")
            return None
        n = len(raw) // HASH_BYTES
        if n < len(self.params) and all(
                isinstance(p.get("since"), int) and p["since"] > step for p in self.params[n:]):
            # parameters that joined the optimizers after this step: not recorded yet (NO_HASH)
            raw += NO_HASH * (len(self.params) - n)
        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, HASH_BYTES)

    _line_hint: int = field(default=1 << 16, repr=False, compare=False)

    def _read_line(self, offset: int) -> bytes:
        """The line at ``offset``, usually in one read (a rank's hash lines have one length)."""
        with open(self.path / HASHES_FILE, "rb", buffering=0) as f:
            f.seek(offset)
            buf = f.read(self._line_hint)
            end = buf.find(b"\n")
            while end < 0:
                more = f.read(max(len(buf), 1 << 16))
                if not more:
                    raise ValueError("line without end")
                start = len(buf)
                buf += more
                end = buf.find(b"\n", start)
        self._line_hint = end + 64
        return buf[:end]


def _parse_hash_line(line: bytes) -> tuple[dict, bytes]:
    """A hashes.jsonl line: (record without "hashes", raw hash bytes). RankWriter puts "hashes"
    last, so the 32*n hex characters are sliced and decoded without a JSON pass over them; any
    other layout goes through ``json``."""
    key = line.rfind(b'"hashes":"')
    if key > 0 and line.endswith(b'"}') and line[key - 1:key] == b",":
        head = json.loads(line[:key - 1] + b"}")
        if isinstance(head, dict) and "hashes" not in head:
            return head, binascii.unhexlify(line[key + 10:-2])
    rec = json.loads(line)
    return rec, bytes.fromhex(rec["hashes"])


@dataclass
class Run:
    """A run directory: run-level metadata and each rank's data."""

    path: Path
    run_meta: dict | None
    ranks: dict[int, RankData]
    problems: list[str]

    @property
    def world_size(self) -> int | None:
        for r in self.ranks.values():
            ws = r.meta.get("world_size")
            if isinstance(ws, int):
                return ws
        return None

    @property
    def missing_ranks(self) -> list[int]:
        ws = self.world_size
        if ws is None:
            return []
        return [r for r in range(ws) if r not in self.ranks]

    def step_numbers(self) -> list[int]:
        """Steps complete on every rank present."""
        sets = [set(r.steps) for r in self.ranks.values()]
        return sorted(set.intersection(*sets)) if sets else []

    def steps_frame(self):
        import pandas as pd

        rows = [
            {"rank": r.rank, "step": s, "param_digest": rec.get("param_digest"),
             "grad_digest": rec.get("grad_digest"), "loss": rec.get("loss"),
             "loss_hash": rec.get("loss_hash")}
            for r in self.ranks.values() for s, rec in sorted(r.steps.items())
        ]
        return pd.DataFrame(rows, columns=["rank", "step", "param_digest", "grad_digest", "loss",
                                           "loss_hash"])

    def buckets_frame(self):
        """One row per bucket entry (the layout table the diff and reports share)."""
        import pandas as pd

        rows = []
        for r in self.ranks.values():
            for b in r.buckets:
                for pos, e in enumerate(b.get("entries", [])):
                    rows.append({
                        "rank": r.rank, "source": b.get("source"), "collective": b.get("collective"),
                        "graph": b.get("graph"), "graph_id": b.get("graph_id"), "step": b.get("step"),
                        "index": b.get("index"), "group": b.get("group"), "position": pos,
                        "fqn": e.get("fqn"), "offset": e.get("offset"), "size": e.get("size"),
                        "numel": e.get("numel"), "dtype": e.get("dtype"),
                        "shape": tuple(e.get("shape") or ()),
                    })
        return pd.DataFrame(rows, columns=["rank", "source", "collective", "graph", "graph_id",
                                           "step", "index", "group", "position", "fqn", "offset",
                                           "size", "numel", "dtype", "shape"])


@contextlib.contextmanager
def gc_paused():
    """Parsing JSON builds millions of acyclic objects; the cyclic collector would rescan them
    over and over (a 256-rank run read in 19 s instead of 2.5 s)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def read_rank(path: Path, rank: int, _shared: dict[bytes, list[dict]] | None = None) -> RankData:
    problems: list[str] = []
    meta = _read_json(path / META_FILE, problems) or {}
    pobj = _read_json(path / "params.json", problems) or {}
    params = pobj.get("params") if isinstance(pobj.get("params"), list) else []
    params = [p for p in params if isinstance(p, dict) and isinstance(p.get("fqn"), str)]
    steps: dict[int, dict] = {}
    for rec in _read_lines(path / STEPS_FILE, problems, ("step", "param_digest")):
        if isinstance(rec["step"], int):
            steps[rec["step"]] = rec
    buckets = _read_lines(path / BUCKETS_FILE, problems,
                          ("source", "collective", "index", "entries"), _shared,
                          check=lambda b: isinstance(b["entries"], list))
    if not (path / BUCKETS_FILE).exists():
        problems = [p for p in problems if not p.endswith("buckets.jsonl: missing")]
    said = meta.get("rank")
    if isinstance(said, int) and not isinstance(said, bool) and said != rank:
        # A directory renamed, copied or swapped: its hashes belong to another rank.
        problems.append(f"{path}: meta.json says rank {said}, the directory rank {rank} "
                        "(swapped or copied directories?); not compared")
        params, steps = [], {}
    return RankData(rank, path, meta, params, steps, buckets, problems, refused_records(path))


def read_run(path: str | os.PathLike) -> Run:
    """Read a run directory. Raises ArtifactError only when it is not a parity run at all."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such directory")
    if not path.is_dir():
        raise ArtifactError(f"{path}: not a directory")
    problems: list[str] = []
    run_meta = None
    if (path / RUN_FILE).exists():
        run_meta = _read_json(path / RUN_FILE, problems)
    ranks: dict[int, RankData] = {}
    try:
        children = sorted(path.iterdir())
    except OSError as e:
        raise ArtifactError(f"{path}: unreadable ({e.strerror or e})") from None
    shared: dict[bytes, list[dict]] = {}
    with gc_paused():
        for child in children:
            r = rank_of(child.name)
            if r is not None and child.is_dir():
                rd = read_rank(child, r, shared)
                ranks[rd.rank] = rd
                problems.extend(rd.problems)
    if not ranks:
        if run_meta is not None:
            status = run_meta.get("status")
            raise ArtifactError(
                f"{path}: the run recorded no rank data (run status {status!r}, "
                f"exit code {run_meta.get('exit_code')!r})"
            )
        hint = ""  # a sweep's cell or the sweep itself given where a run was expected
        if (Path(path) / "cell.json").is_file():
            hint = (f"; it is a sweep cell: compare its sides with `parity diff "
                    f"{Path(path) / 'reference'} {Path(path) / 'candidate'}`")
        elif (Path(path) / "sweep.json").is_file():
            hint = f"; it is a sweep directory: `parity report {path}` or `parity gate {path}`"
        raise ArtifactError(f"{path}: not a parity run directory (no rank-NNNNN/ folders){hint}")
    return Run(path, run_meta, ranks, problems)
