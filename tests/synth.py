"""Synthetic run directories, written with the real :class:`parity.artifacts.RankWriter`.

Used by the diff tests and by benchmarks::

    from tests.synth import make_run
    a = make_run(tmp / "a", world_size=2, steps=3, n_params=8)
    b = make_run(tmp / "b", world_size=2, steps=3, n_params=8, bucket_layout="graph",
                 diverge_at=2, diverge_rank=1, diverge_param="layers.0.attention.wk.weight")

Model of a run
--------------
* ``steps=N`` records steps ``0..N`` (step 0: parameters before the first optimizer step, no
  gradients; step k: parameters after optimizer step k and the gradients it consumed), every
  ``every``-th step plus the first and last, like capture does.
* Parameter ``i`` (registration order) is ``layers.{i // params_per_layer}.<name>``, a 2-D tensor
  sharded on dim 0 (``Shard(dim=0)``) with uneven row counts so that shards are padded.
* Hashes are random bytes drawn from ``numpy.random.default_rng([seed, step, rank])`` for the
  (kind, parameter) grid of one rank's step, so two runs with the same ``seed``, ``world_size`` and
  ``n_params`` are bitwise identical whatever their storage order (``param_order``), bucket layout
  or divergence elsewhere. A divergent entry is the base hash XOR a constant.
* Divergence (``diverge_at=k``) changes the named (rank, parameter) entries of ``kind`` at step k;
  with ``propagate=True`` (default) it also changes what a real job would change afterwards:
  ``kind="grad"``: grad and param of those entries at step k, then every hash and loss from step
  k+1 on; ``kind="param"`` (an optimizer-side divergence): the params at step k, then everything
  from k+1 on; ``kind="loss"`` (a forward-side divergence): the loss of those ranks at step k,
  every gradient of those ranks and the named params at k, then everything from k+1 on.
  ``propagate=False`` changes only the named hashes of ``kind`` at step k.
* Buckets (``bucket_layout="fsdp2"`` eager manifests or ``"graph"`` compiled manifests, ``None``
  for none): one bucket per layer by default (``bucket_groups``), all-gathers in registration
  order, reduce-scatters in reverse layer order (backward). ``bucket_order="reversed-rs"`` reverses
  the payload order inside every reduce-scatter bucket (what a backward-graph-order bucketing
  does), ``"reversed"`` every bucket's; a callable ``(collective, index, fqns) -> fqns`` anything
  else. ``bucket_hook(bucket, rank)`` may edit (or drop, returning None) any record before it is
  written, per rank.

Speed: a 256-rank x 25-step x 1,500-parameter run (params and grads, ~830 MB) takes 8-15 s on the
2-core dev machine (one RankWriter per rank at a time; every record written through the writer, so that meta.json
records each closed file as capture does; the writer's fsyncs skipped unless ``fsync=True``).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from parity.artifacts import HASH_BYTES, NO_HASH, RankWriter

LAYER_NAMES = (
    "attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
    "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
    "attention_norm.weight", "ffn_norm.weight",
)
_FLIP = np.uint8(0x5A)  # a divergent hash is the base hash XOR this
_COLS = 16  # columns of every synthetic parameter
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def default_fqns(n_params: int, params_per_layer: int = 4) -> list[str]:
    names = list(LAYER_NAMES) + [f"p{j}" for j in range(len(LAYER_NAMES), params_per_layer)]
    return [f"layers.{i // params_per_layer}.{names[i % params_per_layer]}" for i in range(n_params)]


def _global_rows(i: int, world_size: int) -> int:
    return 2 * world_size + (i % 3)  # uneven: shards are padded for i % 3 != 0


def param_table(fqns: Sequence[str], world_size: int, rank: int, dtype: str = "float32") -> list[dict]:
    """params.json rows (registration order) of one rank."""
    coord = [rank]
    rows = []
    for i, fqn in enumerate(fqns):
        g = _global_rows(i, world_size)
        per = -(-g // world_size)
        local = max(0, min(per, g - rank * per))
        rows.append({"fqn": fqn, "raw_fqn": "_orig_mod." + fqn, "shape": [local, _COLS],
                     "global_shape": [g, _COLS], "dtype": dtype, "placement": "Shard(dim=0)",
                     "mesh_coord": coord})
    return rows


def _as_indices(sel, fqns: Sequence[str], what: str) -> list[int]:
    if sel is None or isinstance(sel, (int, np.integer, str)):
        sel = [sel if sel is not None else 0]
    out = []
    for s in sel:
        if isinstance(s, str):
            try:
                out.append(fqns.index(s))
            except ValueError:
                raise ValueError(f"{what}: no parameter named {s!r}") from None
        else:
            out.append(int(s))
    return out


def _groups(fqns: Sequence[str], bucket_groups, params_per_layer: int) -> list[tuple[str, list[int]]]:
    n = len(fqns)
    if bucket_groups is None:
        bucket_groups = params_per_layer
    if isinstance(bucket_groups, int):
        out = []
        for start in range(0, n, bucket_groups):
            idx = list(range(start, min(n, start + bucket_groups)))
            out.append((f"layers.{start // params_per_layer}" if bucket_groups == params_per_layer
                        else f"bucket{len(out)}", idx))
        return out
    out = []
    for k, g in enumerate(bucket_groups):
        if isinstance(g, tuple) and len(g) == 2 and isinstance(g[0], str) and not isinstance(g[1], str):
            name, members = g
        else:
            name, members = f"bucket{k}", g
        out.append((name, _as_indices(list(members), fqns, "bucket_groups")))
    return out


def bucket_records(fqns: Sequence[str], world_size: int, layout: str = "fsdp2", *,
                   bucket_groups=None, params_per_layer: int = 4, bucket_order=None,
                   dtype: str = "float32") -> list[dict]:
    """The bucket records (buckets.jsonl lines, without "v") of one rank, in issue order."""
    groups = _groups(fqns, bucket_groups, params_per_layer)
    where = {f: i for i, f in enumerate(fqns)}
    item = _ITEMSIZE.get(dtype, 4)
    graph = layout == "graph"
    records = []
    for coll, ordered in (("all_gather", groups), ("reduce_scatter", groups[::-1])):
        for index, (name, members) in enumerate(ordered):
            names = [fqns[i] for i in members]
            if callable(bucket_order):
                names = list(bucket_order(coll, index, names))
            elif bucket_order == "reversed" or (bucket_order == "reversed-rs"
                                                and coll == "reduce_scatter"):
                names = names[::-1]
            elif bucket_order not in (None, "reversed-rs"):
                raise ValueError(f"bucket_order: unknown {bucket_order!r}")
            entries, offset = [], 0
            for fqn in names:
                i = where[fqn]
                per = -(-_global_rows(i, world_size) // world_size)
                numel = per * _COLS
                entries.append({"fqn": fqn, "offset": offset, "size": numel * item, "numel": numel,
                                "dtype": dtype, "shape": [per, _COLS]})
                offset += numel * item
            records.append({
                "source": "graph" if graph else "fsdp2", "collective": coll,
                "graph": ("forward" if coll == "all_gather" else "backward") if graph else None,
                "graph_id": 0 if graph else None, "step": 1, "index": index, "group": name,
                "node": (f"{coll}_bucket_{index}" if graph else None), "dtype": dtype,
                "world_size": world_size, "total_bytes": offset, "entries": entries,
            })
    return records


def _divergence(n: int, ranks: list[int], params: list[int], kind: str, propagate: bool):
    """Masks [param|grad, parameter] of what differs: from the step after the divergence on
    (with propagation), and at the divergence step per rank; and the ranks whose loss differs
    at that step."""
    flip_all = np.ones((2, n), dtype=bool) if propagate else None
    at: dict[int, np.ndarray] = {}
    loss_ranks: set[int] = set()
    for r in ranks:
        m = at.setdefault(r, np.zeros((2, n), dtype=bool))
        if kind == "grad":
            m[1, params] = True
            if propagate:
                m[0, params] = True
        elif kind == "param":
            m[0, params] = True
        else:  # loss: a forward divergence on this rank
            loss_ranks.add(r)
            if propagate:
                m[1, :] = True
                m[0, params] = True
    return flip_all, at, loss_ranks


@contextlib.contextmanager
def _no_fsync():
    """Synthetic data need not survive a power cut: skip the writer's fsyncs while generating."""
    real = os.fsync
    os.fsync = lambda fd: None
    try:
        yield
    finally:
        os.fsync = real


def _figures_of(raw: bytes) -> bytes:
    """Per-row figures (sum, sum of squares, max |x|) that follow the hashes: equal hashes give
    equal figures, differing ones differing figures (what capture's figures would show)."""
    u = np.frombuffer(raw, dtype="<u8").reshape(-1, 2).astype(np.float64) / 2.0 ** 64
    return np.stack([u[:, 0] - 0.5, u[:, 0] ** 2 + u[:, 1], np.abs(u[:, 1])], 1).astype("<f8").tobytes()
def unclose(run: str | os.PathLike, rank: int) -> None:
    """Drop ``closed_files`` from a rank's meta.json: its files then read as those of a writer
    that was killed (or of a parity before the record), checked by their contents alone. A test
    that edits a closed rank's files to build a case (a table rewritten with a consistent
    digest, a torn tail) calls it first; otherwise the edit is damage (docs/artifacts.md)."""
    import json

    path = Path(run) / f"rank-{rank:05d}" / "meta.json"
    meta = json.loads(path.read_text())
    meta.pop("closed_files", None)
    path.write_text(json.dumps(meta))


def make_run(
    out_dir: str | os.PathLike,
    world_size: int = 2,
    steps: int = 3,
    n_params: int = 8,
    *,
    seed: int = 0,
    fqns: Sequence[str] | None = None,
    params_per_layer: int = 4,
    param_order: str | Sequence[int] | None = None,
    grads: bool = True,
    loss: bool = True,
    every: int = 1,
    diverge_at: int | None = None,
    diverge_rank: int | Iterable[int] | str = 0,
    diverge_param: int | str | Iterable[int | str] = 0,
    kind: str = "grad",
    propagate: bool = True,
    no_grad: Iterable[int | str] = (),
    bucket_layout: str | None = "fsdp2",
    bucket_groups=None,
    bucket_order=None,
    bucket_hook: Callable[[dict, int], dict | None] | None = None,
    extra_buckets: Iterable[dict] = (),
    missing_ranks: Iterable[int] = (),
    stop_after: dict[int, int] | int | None = None,
    torn_tail: Iterable[int] = (),
    status: str = "ok",
    run_json: bool = True,
    fsync: bool = False,
    schema: int = 2,
    figures: bool = False,
) -> Path:
    """Write a synthetic run directory; returns its path. See the module docstring.

    ``param_order``: storage order of params.json/hashes (``"reversed"``, ``"shuffled"`` or a
    permutation of registration indices). ``missing_ranks``: ranks with no directory.
    ``stop_after``: last step recorded (an int for every rank or ``{rank: step}``), as if killed.
    ``torn_tail``: ranks whose steps.jsonl and hashes file end with half a line (record), as a
    killed writer leaves them (no closed-file record: :func:`unclose`).
    ``extra_buckets``: more bucket records appended on every rank (e.g. a later layout change).
    ``schema=1``: written by the schema-1 writer (tests/schema_v1.py), as parity wrote runs
    before schema 2. ``figures``: figures records next to the hashes (issue 34), as capture
    writes them since.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = list(fqns) if fqns is not None else default_fqns(n_params, params_per_layer)
    n = len(names)
    if kind not in ("grad", "param", "loss"):
        raise ValueError(f"kind: expected grad, param or loss, not {kind!r}")

    if param_order is None:
        order = np.arange(n)
    elif param_order == "reversed":
        order = np.arange(n)[::-1].copy()
    elif param_order == "shuffled":
        order = np.random.default_rng([seed, 7919]).permutation(n)
    else:
        order = np.asarray(list(param_order), dtype=np.int64)
        if sorted(order.tolist()) != list(range(n)):
            raise ValueError("param_order: not a permutation of the parameters")

    if diverge_rank == "all":
        div_ranks = list(range(world_size))
    elif isinstance(diverge_rank, (int, np.integer)):
        div_ranks = [int(diverge_rank)]
    else:
        div_ranks = [int(r) for r in diverge_rank]
    div_params = _as_indices(diverge_param if not isinstance(diverge_param, (list, tuple, set))
                             else list(diverge_param), names, "diverge_param")
    no_grad_idx = _as_indices(list(no_grad), names, "no_grad") if no_grad else []

    recorded = [s for s in range(steps + 1) if s == 0 or s == steps or s % every == 0]
    if isinstance(stop_after, int):
        stop = {r: stop_after for r in range(world_size)}
    else:
        stop = dict(stop_after or {})
    skip = set(missing_ranks)
    live = [r for r in range(world_size) if r not in skip]

    buckets = []
    if bucket_layout is not None:
        buckets = bucket_records(names, world_size, bucket_layout, bucket_groups=bucket_groups,
                                 params_per_layer=params_per_layer, bucket_order=bucket_order)
    buckets += list(extra_buckets)

    flip_all, flip_at, flip_loss_at = _divergence(n, div_ranks, div_params, kind, propagate)
    meta = {"world_size": world_size, "host": "synth", "argv": ["synth"], "torch": "synthetic",
            "parity": "0.1.0", "device": "cpu", "deterministic": True, "num_threads": 1,
            "interop_threads": 1,
            "capture": {"every": every, "grads": grads,
                        "manifests": [bucket_layout] if bucket_layout else [],
                        "hasher": "xxh3", "warnings": []}}
    if schema not in (1, 2):
        raise ValueError(f"schema: 1 or 2, not {schema!r}")
    if schema == 1:
        from tests.schema_v1 import RankWriterV1 as writer
    else:
        writer = RankWriter
    with (contextlib.nullcontext() if fsync else _no_fsync()):
        for r in live:  # rank-major: one writer (three files) open at a time
            w = writer(out, r, {**meta, "local_rank": r, "pid": 1000 + r})
            table = param_table(names, world_size, r)
            w.write_params([table[i] for i in order])
            for bk in buckets:
                rec = bucket_hook(copy.deepcopy(bk), r) if bucket_hook else bk
                if rec is not None:
                    w.write_bucket(rec)
            last = stop.get(r)
            for s in recorded:
                if last is not None and s > last:
                    break
                # hashes of (step, rank): [param|grad, parameter, 16 bytes], registration order
                rng = np.random.default_rng([seed, s, r])
                base = np.frombuffer(rng.bytes(2 * n * HASH_BYTES), dtype=np.uint8)
                base = base.reshape(2, n, HASH_BYTES)
                flip_loss = False
                if diverge_at is not None and s >= diverge_at:
                    if s == diverge_at:
                        flip = flip_at.get(r)
                        flip_loss = r in flip_loss_at
                    else:
                        flip = flip_all
                        flip_loss = propagate
                    if flip is not None and flip.any():
                        base = base.copy()
                        base[flip] ^= _FLIP
                if no_grad_idx:
                    base = base.copy() if not base.flags.writeable else base
                    base[1, no_grad_idx] = 0
                ph = base[0][order].tobytes()
                gh = base[1][order].tobytes() if (grads and s > 0) else None
                lv = lh = None
                if loss and s > 0:
                    lv = 1.0 + float(np.random.default_rng([seed, s, r, 1]).random())
                    if flip_loss:
                        lv = float(np.nextafter(lv, np.inf))
                    lh = np.float64(lv).tobytes().hex().ljust(2 * HASH_BYTES, "0")
                if figures and schema == 2:  # issue 34: figures follow the hashes (equal with them)
                    w.write_step(s, ph, gh, loss=lv, loss_hash=lh,
                                 param_figures=_figures_of(ph),
                                 grad_figures=None if gh is None else _figures_of(gh))
                else:
                    w.write_step(s, ph, gh, loss=lv, loss_hash=lh)
            w.close(status=status)
            if r in torn_tail:  # as a killed writer leaves its files: no closed-file record
                unclose(out, r)
                with open(w.dir / "steps.jsonl", "ab") as f:
                    f.write(b'{"v": 1, "step": 99, "param_dig')
                if schema == 1:
                    with open(w.dir / "hashes.jsonl", "ab") as f:
                        f.write(b'{"v": 1, "step": 99, "kind": "pa')
                else:
                    with open(w.dir / "hashes.bin", "ab") as f:
                        f.write(b"PRH2\x00\x00")
        if run_json:
            from parity.artifacts import write_json_atomic

            write_json_atomic(out / "run.json", {
                "v": schema, "argv": ["synth"], "cwd": str(out), "started": 0.0, "ended": 1.0,
                "exit_code": 0 if status == "ok" else 1,
                "status": "ok" if status == "ok" else "failed", "error": None,
                "parity": "0.1.0", "host": "synth"})
    return out


__all__ = ["make_run", "bucket_records", "param_table", "default_fqns", "NO_HASH"]
