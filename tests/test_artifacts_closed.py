"""meta.json's ``closed_files`` (issue 23, "reading 256 ranks"): what a reader may skip because
the writer recorded it, and that it is never trusted once a file was touched.

The writer records, at close, each closed file's size and times (and the xxh3-128 of
buckets.jsonl); a reader that finds a file exactly so reads the bucket records of only one rank
per distinct manifest and only the header of params.json. Any edit changes the change time (no
tool can set it back), so an edited file is read and checked as in a run without the record.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import artifacts  # noqa: E402
from parity.artifacts import read_run  # noqa: E402
from parity.diff import diff_runs  # noqa: E402
from tests.synth import make_run  # noqa: E402

COMMON = {"world_size": 4, "steps": 3, "n_params": 12}


def _next_tick() -> None:
    """Let the file-time clock move on: Linux stamps files from a coarse clock (one tick, 1-10
    ms), and a file touched within the tick its writer closed it in keeps the recorded times."""
    time.sleep(0.1)


def _meta(run: Path, rank: int) -> dict:
    return json.loads((run / f"rank-{rank:05d}" / "meta.json").read_text())


def _spy_reads(monkeypatch) -> list[tuple[str, int | None]]:
    reads: list[tuple[str, int | None]] = []
    real = artifacts._read_bytes

    def spy(path, limit=None):
        reads.append((os.path.basename(path), limit))
        return real(path, limit)

    monkeypatch.setattr(artifacts, "_read_bytes", spy)
    return reads


def test_the_writer_records_each_closed_file(tmp_path):
    run = make_run(tmp_path / "a", **COMMON)
    for r in range(4):
        closed = _meta(run, r)["closed_files"]
        folder = run / f"rank-{r:05d}"
        # every record file (issue 32): a file changed after close is seen without reading it
        for name in ("params.json", "steps.jsonl", "hashes.bin", "buckets.jsonl"):
            st = os.stat(folder / name)
            assert closed[name]["stat"] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
            data = (folder / name).read_bytes()
            assert data and closed[name]["xxh3"] == xxhash.xxh3_128_hexdigest(data)


def test_equal_closed_manifests_are_read_once_and_tables_by_their_header(tmp_path, monkeypatch):
    a = make_run(tmp_path / "a", **COMMON)
    b = make_run(tmp_path / "b", **COMMON)
    reads = _spy_reads(monkeypatch)
    r = diff_runs(a, b)
    assert r.verdict == "match" and not r.problems
    # eight ranks, one manifest: read once; every table: its header, and one whole (its rows
    # give the alignment every rank shares)
    assert [x for x in reads if x[0] == "buckets.jsonl"] == [("buckets.jsonl", None)]
    tables = [x for x in reads if x[0] == "params.json"]
    assert len([x for x in tables if x[1] is not None]) == 8
    assert len([x for x in tables if x[1] is None]) == 1


def test_a_manifest_edited_after_close_is_read_even_with_its_size_and_mtime_kept(tmp_path):
    """Two parameters swapped inside one bucket on B's rank 1 (same bytes count), the
    modification time set back: the change time gives it away, the file is read, the rank's
    layout is seen to differ."""
    a = make_run(tmp_path / "a", **COMMON)
    b = make_run(tmp_path / "b", **COMMON)
    p = b / "rank-00001" / "buckets.jsonl"
    st = os.stat(p)
    data = p.read_bytes()
    _next_tick()
    x, y = b"layers.0.attention.wq.weight", b"layers.0.attention.wk.weight"
    assert x in data and y in data and len(x) == len(y)
    swapped = data.replace(x, b"\0").replace(y, x).replace(b"\0", y)
    p.write_bytes(swapped)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(p).st_size == st.st_size and os.stat(p).st_mtime_ns == st.st_mtime_ns
    r = diff_runs(a, b)
    assert r.order.rank_disagreements["b"], r.order.rank_disagreements
    assert any("rank 1" in m for m in r.order.rank_disagreements["b"])


def test_a_recorded_digest_the_bytes_do_not_have_is_said(tmp_path):
    """meta.json edited (the file's times still as recorded): the reader does not find the
    other ranks' list under the wrong digest, reads the file and says it."""
    run = make_run(tmp_path / "a", **COMMON)
    meta_path = run / "rank-00002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["closed_files"]["buckets.jsonl"]["xxh3"] = "0" * 32
    meta_path.write_text(json.dumps(meta))
    got = read_run(run)
    assert any("rank-00002/buckets.jsonl: its bytes are not those recorded" in m
               for m in got.problems), got.problems
    assert got.ranks[2].buckets == got.ranks[0].buckets  # read as found: the same records


def test_a_table_read_by_its_header_is_checked_when_its_rows_are_needed(tmp_path):
    run = make_run(tmp_path / "a", **COMMON)
    rd = read_run(run).ranks[1]
    assert rd.table.data is None and rd.table.rows is None  # the header only
    assert [p["fqn"] for p in rd.params][:2] == ["layers.0.attention.wq.weight",
                                                 "layers.0.attention.wk.weight"]
    # rewritten between the read and the first use: not decoded, said
    rd = read_run(run).ranks[1]
    p = run / "rank-00001" / "params.json"
    p.write_bytes(p.read_bytes().replace(b'"float32"', b'"float16"'))
    assert rd.params == []
    assert any("params.json" in m and "not compared" in m for m in rd.problems), rd.problems


def test_a_run_copied_elsewhere_reads_as_a_run_without_the_record(tmp_path, monkeypatch):
    """A copy has new change times: every file is read and checked, the verdict is the same."""
    import shutil

    a = make_run(tmp_path / "a", **COMMON)
    original = make_run(tmp_path / "b", **COMMON)
    _next_tick()
    b = shutil.copytree(original, tmp_path / "b-copy")
    reads = _spy_reads(monkeypatch)
    r = diff_runs(a, b)
    assert r.verdict == "match" and not r.problems
    assert len([x for x in reads if x[0] == "buckets.jsonl"]) == 1 + 4  # A's one, B's all
    # B's tables checked whole, A's by their header; one decoded for its rows
    assert len([x for x in reads if x == ("params.json", None)]) == 4 + 1


@pytest.mark.parametrize("line", [
    '{"v":2,"source":"fsdp2","index":0,"entries":[{"fqn":"a","offset":0}]}',
    '{"v":2,"entries":[]}',
    '{"v":2,"extra":{"entries":[1]},"entries":[{"fqn":"b"}]}',
    '{"v":2,"entries":[1],"index":3}',
    '{"v":2,"entries":null}',
    '{"v":2,"entries":[1],"entries":[2]}',
    '  {"v":2,"entries":[1]}',
    '[1,{"v":2,"entries":[1]}]',
])
def test_the_entries_sharing_parser_reads_what_json_reads(line):
    parse = artifacts._tail_sharing_parser("entries")
    assert parse(line) == json.loads(line)
    assert parse(line) == json.loads(line)  # the second time from its memo


def test_a_bad_line_among_good_ones_is_still_said_by_line(tmp_path):
    p = tmp_path / "steps.jsonl"
    good = '{"v":2,"step":%d,"param_digest":"x"}'
    p.write_text("\n".join([good % 0, "{not json", good % 2, ""]))
    problems: list[str] = []
    recs = artifacts._read_lines(p, problems, ("step", "param_digest"))
    assert [r["step"] for r in recs] == [0, 2]
    assert problems == [f"{p}:2: not JSON, skipped"]
