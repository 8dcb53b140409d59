"""Eager DTensor collectives (parity/capture/sources/eager_collectives.py) on a real 1-rank gloo job."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TRAINER = Path(__file__).resolve().parent / "trainers" / "dtensor_chunked_loss.py"


def test_chunked_redistributions_are_recorded_with_parameter_and_module(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, str(TRAINER), str(out)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "capture disabled" not in p.stderr
    recs = [json.loads(line) for line in (out / "rank-00000" / "buckets.jsonl").read_text()
            .splitlines()]
    got = [(b["step"], b["collective"], b["module"], b["entries"][0]["fqn"], b["dtype"],
            b["entries"][0]["shape"], b["placements"]) for b in recs if b["source"] == "dtensor"]
    # a bool mask of the weight's shape under the same module is not the weight (named by
    # memory only: a tensor of bool or integer values is no cast of a parameter)
    chunk = [(1, "all_gather", "loss_fn(ChunkLoss) > 0", None, "bool", [4, 3],
              "Shard(dim=0) -> Replicate()"),
             (1, "all_gather", "loss_fn(ChunkLoss) > 0", "0.weight", "float32", [4, 3],
              "Shard(dim=0) -> Replicate()"),
             # the Partial gradient reduce-scattered in Redistribute's backward: the weight's
             # (round 10c: named by the AccumulateGrad it feeds; it was null)
             (1, "reduce_scatter", "loss_fn(ChunkLoss)", "0.weight", "float32", [4, 3],
              "Partial(sum) -> Shard(dim=0)")]
    assert got == chunk * 2  # step 2 repeats step 1's sequence: not written again
    # module attribution (issue 14): the weight's all-gather was issued under the loss function
    from parity.artifacts import read_run
    from parity.diff.bucket_summary import summarize_run

    found = summarize_run(read_run(out))["attribution"]
    # and (round 10c, now that it is named) its gradient's reduce-scatter, run by the backward
    # that the loss function calls per chunk
    assert [(a["fqn"], a["module"], a["collective"]) for a in found] == [
        ("0.weight", "loss_fn(ChunkLoss) > 0", "all_gather"),
        ("0.weight", "loss_fn(ChunkLoss)", "reduce_scatter")]
    meta = json.loads((out / "rank-00000" / "meta.json").read_text())
    assert "dtensor" in meta["capture"]["manifests"]


def test_a_redistribution_along_one_mesh_dimension_records_that_groups_ranks():
    """A DTensor line's ``ranks`` (2026-11-28): the group of the one mesh dimension it
    redistributes along, for rank 0 of a (2, 2) mesh [[0, 1], [2, 3]]: dim 0 is {0, 2}, dim 1
    {0, 1}; along both dimensions (the whole world) or none, no ranks. A fake process group of
    four ranks, in a process of its own (a module of this session may hold a world of two)."""
    code = textwrap.dedent("""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from parity.capture.sources.eager_collectives import _mesh_dim_ranks
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2))
        print(_mesh_dim_ranks(mesh, [0]), _mesh_dim_ranks(mesh, [1]),
              _mesh_dim_ranks(mesh, [0, 1]), _mesh_dim_ranks(mesh, []))
        dist.destroy_process_group()
    """)
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split("\n")[0] == "[0, 2] [0, 1] None None"
