"""Early stop (spec ``stop_after_divergence = K``): watch a cell's two runs while they train and
say when both have recorded K steps past their first divergent step.

Why: a job that has diverged keeps burning GPU-hours for steps that only repeat "still
different". The runner asks :class:`DivergenceWatch` on every poll; once it answers, the runner
stops the jobs (the launcher's cancel: SIGTERM to the job's process tree, or ``scancel``) and
keeps the cell as a divergence.

What it reads: each rank's ``steps.jsonl`` incrementally (only the bytes appended since the last
poll; a last line without its newline is left for the next poll), from wherever the rank is
writing now (``rundir.live_rank_dir``: a multi-node job writes under ``nodes/node-K/`` until its
merge). A (rank, step) is compared once both sides recorded it: the per-step roll-up digests
(params, grads) when the rank's two parameter tables list the same names in the same order (the
common case), else the per-parameter hashes aligned by name; and the loss (its hash, else its
value). The first divergent step is only concluded over steps that every rank of both sides has
recorded, so a slow rank cannot hide an earlier divergence. The diff engine decides the cell's
verdict afterwards, from the files, exactly as without an early stop.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from parity import params_codec
from parity.diff.engine import _loss_bits  # one rule for "the loss is bitwise equal"
from parity.rundir import STEPS_FILE, live_rank_dir

__all__ = ["DivergenceWatch"]


class _Tail:
    """The complete lines appended to one rank's steps.jsonl since the last read."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.offset = 0
        self.steps: dict[int, dict] = {}

    def read(self, rank_folder: Path | None) -> None:
        if rank_folder is None:
            return
        path = rank_folder / STEPS_FILE
        if path != self.path:  # the rank moved (multi-node merge): same lines, read them again
            self.path, self.offset = path, 0
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n")
        if end < 0:
            return
        self.offset += end + 1
        for line in data[:end].split(b"\n"):
            try:
                rec = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                self.steps[rec["step"]] = rec


def _params(rank_folder: Path | None) -> list | None:
    if rank_folder is None:
        return None
    try:
        data = (rank_folder / "params.json").read_bytes()
    except OSError:
        return None
    try:  # schema 2 (params_codec); schema 1 is one object per row under "params"
        rows = params_codec.decode(data)
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return None
        rows = obj.get("params") if isinstance(obj, dict) else None
    return [p.get("fqn") for p in rows if isinstance(p, dict)] if isinstance(rows, list) else None


class DivergenceWatch:
    """One cell: reference run ``ref_dir`` against candidate run ``cand_dir``."""

    def __init__(self, ref_dir: str | os.PathLike, cand_dir: str | os.PathLike, world_size: int,
                 k: int):
        self.dirs = (Path(ref_dir), Path(cand_dir))
        self.world_size, self.k = world_size, k
        self.tails = [[_Tail() for _ in range(world_size)] for _ in self.dirs]
        self.compared: set[tuple[int, int]] = set()  # (rank, step) compared already
        self.first: int | None = None  # first divergent step found so far
        self.reach = -1  # every rank of both sides recorded steps 0..reach
        self._keys: dict[int, tuple] = {}  # rank -> (ref names, cand names)

    def _folder(self, side: int, rank: int) -> Path | None:
        return live_rank_dir(self.dirs[side], rank)

    def poll(self) -> tuple[int, int] | None:
        """(first divergent step, the step to stop after) once both sides recorded that step
        on every rank; None while that is not known yet."""
        reach = []
        for side in (0, 1):
            for rank in range(self.world_size):
                t = self.tails[side][rank]
                t.read(self._folder(side, rank))
                reach.append(max(t.steps, default=-1))
        self.reach = min(reach) if reach else -1
        for rank in range(self.world_size):
            ta, tb = self.tails[0][rank].steps, self.tails[1][rank].steps
            for step in sorted(set(ta) & set(tb)):
                if step > self.reach or (rank, step) in self.compared:
                    continue
                self.compared.add((rank, step))
                if self._differs(rank, step, ta[step], tb[step]) and (
                        self.first is None or step < self.first):
                    self.first = step
        if self.first is not None and self.reach >= self.first + self.k:
            return self.first, self.first + self.k
        return None

    # --------------------------------------------------------------------------- comparison

    def _differs(self, rank: int, step: int, a: dict, b: dict) -> bool:
        la, lb = _loss_bits(a), _loss_bits(b)
        if la is not None and lb is not None and la[0] == lb[0] and la != lb:
            return True
        keys = self._keys.get(rank)
        if keys is None or keys[0] is None or keys[1] is None:
            keys = (_params(self._folder(0, rank)), _params(self._folder(1, rank)))
            self._keys[rank] = keys
        if keys[0] is not None and keys[0] == keys[1]:
            if a.get("param_digest") != b.get("param_digest"):
                return True
            ga, gb = a.get("grad_digest"), b.get("grad_digest")
            return isinstance(ga, str) and isinstance(gb, str) and ga != gb
        return self._differs_by_name(rank, step)

    def _differs_by_name(self, rank: int, step: int) -> bool:
        """Tables in different orders: compare per-parameter hashes by name (rare; reads the
        step's hash lines through the artifact reader)."""
        from parity.artifacts import read_rank

        try:
            ra = read_rank(self._folder(0, rank), rank)
            rb = read_rank(self._folder(1, rank), rank)
        except (OSError, TypeError):
            return False
        for kind in ("param", "grad"):
            ha, hb = ra.hashes(step, kind), rb.hashes(step, kind)
            if ha is None or hb is None:
                continue
            rows_b = {name: i for i, name in enumerate(rb.fqns)}
            for i, name in enumerate(ra.fqns):
                j = rows_b.get(name)
                if j is not None and i < len(ha) and j < len(hb) and bytes(ha[i]) != bytes(hb[j]):
                    return True
        return False
