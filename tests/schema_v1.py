"""The schema-1 writer (parity 0.1 before the schema-2 layout), kept to write old-format runs.

Used by tests that check that runs written before schema 2 still read and diff the same, and by
benchmarks/run.py as the baseline of the bytes-per-rank-step figure. This is the writer as it
was (docs/artifacts.md, "Schema 1"): hex per-parameter hashes in hashes.jsonl, one JSON row per
parameter in params.json; it imports only parity's atomic-write helper and folder names, so it
keeps writing what it always wrote.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import xxhash

from parity.artifacts import write_json_atomic
from parity.errors import ArtifactError
from parity.rundir import rank_dir

V1 = 1
HASH_BYTES = 16


class _LineFile:
    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "ab", buffering=0)
        self.offset = self._f.seek(0, os.SEEK_END)

    def append(self, record: dict) -> int:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        start = self.offset
        try:
            n = self._f.write(line)
        except OSError as e:
            raise ArtifactError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.offset += n
        return start

    def close(self) -> None:
        self._f.close()


class RankWriterV1:
    """Schema-1 ``RankWriter``: same methods, same arguments."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, meta: dict):
        self.dir = rank_dir(out_dir, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = {"v": V1, "rank": rank, **meta}
        self.meta.setdefault("started", time.time())
        self.meta.setdefault("ended", None)
        self.meta.setdefault("status", "running")
        self.meta.setdefault("error", None)
        write_json_atomic(self.dir / "meta.json", self.meta)
        self._hashes = _LineFile(self.dir / "hashes.jsonl")
        self._steps = _LineFile(self.dir / "steps.jsonl")
        self._buckets = _LineFile(self.dir / "buckets.jsonl")

    def update_meta(self, **updates) -> None:
        self.meta.update(updates)
        write_json_atomic(self.dir / "meta.json", self.meta)

    def write_params(self, params: list[dict]) -> None:
        table = [{"index": i, **p} for i, p in enumerate(params)]
        write_json_atomic(self.dir / "params.json", {"v": V1, "params": table}, indent=None)

    def _hash_line(self, step: int, kind: str, raw: bytes) -> tuple[int, str]:
        digest = xxhash.xxh3_128_hexdigest(raw)
        offset = self._hashes.append(
            {"v": V1, "step": step, "kind": kind, "n": len(raw) // HASH_BYTES,
             "digest": digest, "hashes": raw.hex()})
        return offset, digest

    def write_step(self, step: int, param_hashes: bytes, grad_hashes: bytes | None = None,
                   loss: float | None = None, loss_hash: str | None = None) -> None:
        p_off, p_digest = self._hash_line(step, "param", param_hashes)
        g_off = g_digest = None
        if grad_hashes is not None:
            g_off, g_digest = self._hash_line(step, "grad", grad_hashes)
        self._steps.append(
            {"v": V1, "step": step, "param_digest": p_digest, "grad_digest": g_digest,
             "loss": loss, "loss_hash": loss_hash, "param_offset": p_off, "grad_offset": g_off,
             "time": time.time()})

    def write_bucket(self, bucket: dict) -> None:
        self._buckets.append({"v": V1, **bucket})

    def close(self, status: str = "ok", error: str | None = None) -> None:
        for f in (self._hashes, self._steps, self._buckets):
            f.close()
        self.update_meta(status=status, error=error, ended=time.time())
