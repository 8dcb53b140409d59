"""The typed bucket record (parity/records.py): what every manifest source writes and the diff
reads back, one buckets.jsonl line, unchanged through a read-write round trip."""

from parity.records import BucketEntry, BucketRecord, common_module, dtype_name

ENTRY = {"fqn": "layers.0.w", "offset": 0, "size": 64, "numel": 16, "dtype": "float32",
         "shape": [4, 4]}
LINES = [
    {"source": "fsdp2", "collective": "all_gather", "graph": None, "graph_id": None, "step": 1,
     "index": 0, "group": "layers.0", "node": None, "dtype": "float32", "world_size": 2,
     "total_bytes": 64, "entries": [ENTRY]},
    {"source": "graph", "collective": "reduce_scatter", "graph": "backward", "graph_id": 3,
     "step": 1, "index": 2, "group": "layers", "node": "reduce_scatter_tensor_1",
     "dtype": "bfloat16", "world_size": 8, "total_bytes": 64, "stage": "before_passes",
     "trace": "make_fx", "position": 7, "compute_before": 3, "module": None,
     "entries": [dict(ENTRY, module="layers.0"), dict(ENTRY, fqn="layers.1.w", offset=64,
                                                     module=None)]},
    {"source": "dtensor", "collective": "all_reduce", "graph": None, "graph_id": None, "step": 2,
     "index": 0, "group": "", "node": None, "dtype": "float32", "world_size": 2,
     "total_bytes": 64, "module": "loss_fn(ChunkedLossWrapper) > lm_head",
     "placements": "Partial(sum) -> Replicate()", "from_a_newer_parity": {"x": 1},
     "entries": [dict(ENTRY, fqn=None)]},
]


def test_lines_round_trip():
    for line in LINES:
        rec = BucketRecord.from_dict({"v": 1, **line})
        assert rec.to_dict() == line
        assert list(rec.to_dict())[-1] == "entries"
    assert BucketRecord.from_dict(LINES[2]).extra == {"from_a_newer_parity": {"x": 1}}
    # a key written as null stays null; a key never written stays out
    rec = BucketRecord.from_dict(LINES[1])
    assert rec.module is None and "module" in rec.to_dict()
    assert "module" not in BucketRecord.from_dict(LINES[0]).to_dict()
    assert "module" not in BucketRecord.from_dict(LINES[0]).entries[0].to_dict()


def test_a_malformed_line_reads_as_none_not_as_an_error():
    rec = BucketRecord.from_dict({"source": 1, "index": True, "entries": [
        {"fqn": "w", "offset": "0", "size": None}, "junk"]})
    assert (rec.source, rec.index) == (None, None)
    assert rec.entries == [BucketEntry("w", None, None, None, None, None)]


def test_spelling_helpers():
    import torch

    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert common_module(["a.b.w", "a.b.c.w", None]) == "a.b"
    assert common_module(["w"]) == "" and common_module([]) == ""
