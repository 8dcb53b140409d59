"""parity's FX walker over the graphs each torch version's bucketing passes produced (fixtures in
tests/data/bucketing-graphs/, recorded by tests/bucketing_graphs.py on that torch), run on the
pinned torch: every bucket found, its payloads covering its buffer exactly, in the dtype the pass
copied them in, with no warning. torch 2.11's ``_pre_bucket_all_gather`` takes one dtype where
2.13 takes a list of dtype indices: read by the op's argument names, both are right."""

import json
from pathlib import Path

import pytest
import torch

from bucketing_graphs import CONFIGS, load
from parity.capture.sources import graph_walk

DATA = Path(__file__).parent / "data" / "bucketing-graphs"
FIXTURES = sorted(DATA.glob("torch-*.json"))


def test_a_fixture_for_every_version_checked():
    versions = {p.stem.removeprefix("torch-") for p in FIXTURES}
    assert {"2.11.0", "2.13.0", "2.14.1", "2.15.0"} <= versions, versions


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_walker_reads_every_versions_buckets(path, monkeypatch):
    doc = json.loads(path.read_text())
    if doc["all_dtypes"] is not None:  # indices into the recording torch's own dtype tuple
        from torch._inductor.fx_passes import bucketing

        dtypes = tuple(getattr(torch, d.split(".", 1)[1], None) for d in doc["all_dtypes"])
        monkeypatch.setattr(bucketing, "_ALL_DTYPES", dtypes)
    assert set(doc["graphs"]) == set(CONFIGS)
    for config, graphs in doc["graphs"].items():
        kinds = {g["graph_kind"] for g in graphs}
        assert kinds == {"forward", "backward"}, (config, kinds)
        for g in graphs:
            gm, nodes = load(g)
            warnings: list[str] = []
            rs = {nodes[k]: v for k, v in g["rs_payload_fqns"].items()}
            buckets = graph_walk.extract_buckets(gm, g["input_fqns"], g["output_fqns"],
                                                 g["graph_kind"], warnings=warnings,
                                                 rs_payload_fqns=rs)
            label = f"{path.stem} {config} {g['graph_kind']}"
            assert warnings == [], (label, warnings)
            assert buckets, label
            for b in buckets:
                covered = sum(e.size for e in b.entries)
                assert covered == b.total_bytes, (label, b.node, covered, b.total_bytes)
                assert all(e.fqn for e in b.entries), (label, b.node)
                # each payload's module: where its slice is used (2.15 writes an all-gather's
                # slices with split_with_sizes_copy(out=...): read through the out tensors)
                assert all(e.module is not None for e in b.entries), (label, b.node)
                if config.endswith("bf16") and b.collective == "all_gather":
                    assert b.dtype == "bfloat16" and {e.dtype for e in b.entries} == {"bfloat16"}
            # what the fixed walker found on the recording torch (a reduction's ``op``, written
            # since 2026-11-27, is newer than the fixtures: checked on its own)
            for b in buckets:
                if b.collective == "reduce_scatter":
                    assert b.extra.get("op") in ("avg", "sum"), (label, b.node, b.extra)
            newer = ("extra", "graph_id", "op")
            got = [{k: v for k, v in b.to_dict().items()
                    if k not in newer or (k == "op" and b.collective != "reduce_scatter")}
                   for b in buckets]
            want = [{k: v for k, v in b.items() if k not in ("extra", "graph_id")}
                    for b in g["buckets"]]
            assert got == want, label


def test_pre_bucket_dtypes_by_argument_name():
    """The three signatures seen: one bucket dtype (2.11), a list of indices after a dtype, with
    or without group_name."""
    from types import SimpleNamespace as NS

    def node(names, args):
        return NS(target=NS(_schema=NS(arguments=[NS(name=n) for n in names])), args=args,
                  kwargs={})

    from torch._inductor.fx_passes.bucketing import _ALL_DTYPES

    i = _ALL_DTYPES.index(torch.bfloat16)
    assert graph_walk._pre_bucket_dtypes(
        node(["ag_ins", "group_size", "group_name", "dtype", "rank"],
             ([1, 2], 2, "g", torch.bfloat16, 0)), 2) == [torch.bfloat16] * 2
    assert graph_walk._pre_bucket_dtypes(
        node(["ag_ins", "group_size", "dtype", "out_dtype_ints", "rank"],
             ([1, 2], 2, torch.float32, [i, i], 0)), 2) == [torch.bfloat16] * 2
    assert graph_walk._pre_bucket_dtypes(
        node(["ag_ins", "group_size", "group_name", "dtype", "out_dtype_ints", "rank"],
             ([1], 2, "g", torch.float32, [i], 0)), 1) == [torch.bfloat16]
