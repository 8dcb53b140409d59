"""Artifact schema 2 (issue 23, "reading 256 ranks"): old runs read and diff the same, the
table's digests stand for its rows, and a diff reads only what its verdict needs.

Schema-1 runs come from two places: ``tests/data/v1`` (a real plain_fsdp2 pair recorded by the
schema-1 writer, with the diff and inspect JSON the schema-1 reader gave) and ``tests/synth.py``
with ``schema=1`` (the schema-1 writer kept in tests/schema_v1.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import params_codec  # noqa: E402
from parity.artifacts import RankData, read_run  # noqa: E402
from parity.diff import diff_runs  # noqa: E402
from parity.diff.bucket_summary import summarize_run  # noqa: E402
from tests.synth import make_run, unclose  # noqa: E402

DATA = Path(__file__).parent / "data" / "v1"


def _comparable(d: dict) -> dict:
    """A diff's JSON without what depends on where and how fast it ran."""
    d = json.loads(json.dumps(d))
    d.pop("stats", None)
    for side in ("a", "b"):
        d[side].pop("path", None)
    return d


# ------------------------------------------------------------------ a recorded schema-1 run


@pytest.mark.parametrize("pair", [("a", "b"), ("a", "a")])
def test_recorded_schema_1_runs_diff_as_they_did(pair, tmp_path):
    want = json.loads((DATA / f"diff-{pair[0]}-{pair[1]}.json").read_text())
    b = DATA / pair[1]
    if pair[0] == pair[1]:  # a directory diffed with itself is incomplete (issue 21), and so
        import shutil  # is a copy (one recording): a copy as if another process wrote it

        b = shutil.copytree(b, tmp_path / pair[1])
        for m in b.glob("rank-*/meta.json"):
            meta = json.loads(m.read_text())
            meta["pid"] = meta["pid"] + 100000
            m.write_text(json.dumps(meta))
    got = diff_runs(DATA / pair[0], b).to_dict()
    got["b"]["path"] = want["b"].get("path")
    want = _comparable(want)
    assert _project(_comparable(got), want) == want


def _project(got, want):
    """``got`` cut down to the keys ``want`` has: fields added to the diff's JSON since the
    recording (additive schema changes) are not a change in how an old run reads."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {k: _project(got[k], v) if k in got else "<absent>" for k, v in want.items()}
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [_project(g, w) for g, w in zip(got, want)]
    return got


def test_recorded_schema_1_run_reads_as_it_did():
    run = read_run(DATA / "a")
    assert sorted(run.ranks) == [0, 1] and not run.problems
    rd = run.ranks[0]
    assert rd.table.version == 1 and rd.n_params == len(rd.params) == 17
    assert all("index" not in p for p in rd.params)  # the row position is not a column
    for s in rd.steps:
        assert rd.hashes(s, "param").shape == (17, 16)
    want = json.loads((DATA / "inspect-a.json").read_text())
    assert _project(json.loads(json.dumps(summarize_run(run))), want) == want


# ------------------------------------------------- the schema-1 writer against schema 2


CASES = {
    "identical": {},
    "grad at step 2": {"diverge_at": 2, "diverge_rank": 1, "diverge_param": 3},
    "loss at step 1": {"diverge_at": 1, "kind": "loss", "diverge_rank": [0, 2]},
    "other storage order": {"diverge_at": 3, "param_order": "shuffled"},
    "stopped early": {"stop_after": {1: 2}, "torn_tail": [0]},
    "no gradient": {"no_grad": [2]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Reference A and every case of B, written by both writers."""
    root = tmp_path_factory.mktemp("schemas")
    common = {"world_size": 4, "steps": 4, "n_params": 12}
    out = {}
    for schema in (1, 2):
        out[schema, "A"] = make_run(root / f"v{schema}-A", schema=schema, **common)
        for name, kw in CASES.items():
            out[schema, name] = make_run(root / f"v{schema}-{name}", schema=schema,
                                         **common, **kw)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_schema_1_and_2_runs_diff_the_same(runs, case):
    """Every combination of writers gives one diff: the old writer's pair, the new writer's
    pair, and an old reference against a new candidate (and back)."""
    results = {(sa, sb): _comparable(diff_runs(runs[sa, "A"], runs[sb, case]).to_dict())
               for sa in (1, 2) for sb in (1, 2)}
    want = results[1, 1]
    for key, got in results.items():
        # problems name files: hashes.jsonl in schema 1, hashes.bin in schema 2
        for d in (got, want):
            d["problems"] = [{**p, "message": p["message"].replace("hashes.jsonl", "hashes.*")
                              .replace("hashes.bin", "hashes.*").replace("/v1-", "/v?-")
                              .replace("/v2-", "/v?-")} for p in d["problems"]]
        assert got == want, key


def test_schema_2_is_half_the_bytes_per_rank_step(tmp_path):
    """Per recorded (rank, step): raw 16-byte hashes instead of 32 hex characters in JSON; the
    table is a third of its schema-1 size."""
    def size(run: Path, names: tuple[str, ...]) -> int:
        return sum(f.stat().st_size for f in run.glob("rank-*/*") if f.name in names)

    runs = {s: make_run(tmp_path / f"v{s}", world_size=2, steps=2, n_params=1500, schema=s)
            for s in (1, 2)}
    per_step = [size(runs[s], ("hashes.jsonl", "hashes.bin", "steps.jsonl")) for s in (1, 2)]
    assert per_step[1] <= 0.51 * per_step[0], per_step
    tables = [size(runs[s], ("params.json",)) for s in (1, 2)]
    assert tables[1] < tables[0] / 3, tables


# ------------------------------------------------------ what a diff of equal runs reads


def test_a_diff_of_equal_runs_parses_one_table_per_side_and_reads_no_hash(runs, monkeypatch):
    decoded, read = [], []
    real_decode, real_hashes = params_codec.decode, RankData.hashes
    monkeypatch.setattr(params_codec, "decode", lambda data: decoded.append(1) or real_decode(data))
    monkeypatch.setattr(RankData, "hashes",
                        lambda self, *a, **k: read.append(a) or real_hashes(self, *a, **k))
    r = diff_runs(runs[2, "A"], runs[2, "identical"])
    assert r.verdict == "match" and r.params_compared == 12
    # 4 ranks per side list the same names: one parse for all of them (keys digest); their
    # shapes need no parse at all (table digests equal)
    assert len(decoded) == 1 and read == []


def test_a_divergent_rank_reads_only_its_records(runs, monkeypatch):
    read = []
    real = RankData.hashes
    monkeypatch.setattr(RankData, "hashes",
                        lambda self, *a, **k: read.append((self.rank, *a)) or real(self, *a, **k))
    r = diff_runs(runs[2, "A"], runs[2, "grad at step 2"])
    assert r.first_divergent_step == 2 and r.first_divergence.ranks == [1]
    assert {x[0] for x in read if x[1] == 2} == {1}


# --------------------------------------------------------------------- the table codec


ROWS = [
    {"fqn": "emb.weight", "raw_fqn": "_orig_mod.emb.weight", "shape": [7, 8],
     "global_shape": [13, 8], "dtype": "float32", "placement": "Shard(0)", "mesh_coord": [0]},
    {"fqn": "layers.0.wé", "raw_fqn": "_orig_mod.layers.0.wé", "shape": [4],
     "global_shape": [8], "dtype": "bfloat16", "placement": None, "mesh_coord": None},
    {"fqn": "bn.running_mean", "raw_fqn": "_orig_mod.bn.running_mean", "kind": "buffer",
     "shape": [4], "global_shape": [4], "dtype": "float32", "placement": None,
     "mesh_coord": None},
    {"fqn": "late.bias", "raw_fqn": "_orig_mod.late.bias", "shape": [4], "global_shape": [4],
     "dtype": "float32", "placement": None, "mesh_coord": None, "since": 3},
]


@pytest.mark.parametrize("rows", [ROWS, ROWS[:1], [], [{**r, "raw_fqn": r["fqn"]} for r in ROWS]])
def test_table_round_trips_and_its_header_reads_without_the_columns(rows):
    data = params_codec.encode(rows)
    assert json.loads(data)["v"] == 2  # still one JSON document
    assert params_codec.decode(data) == rows
    digest, n, keys = params_codec.read_header(data)
    assert n == len(rows) and keys == params_codec.keys_digest([r["fqn"] for r in rows])


def test_table_digest_changes_with_any_row_and_catches_any_cut():
    data = params_codec.encode(ROWS)
    base = params_codec.read_header(data)
    for i in range(len(ROWS)):
        for k in ROWS[i]:
            rows = [dict(r) for r in ROWS]
            rows[i][k] = "x" if rows[i][k] != "x" else "y"
            if k == "fqn":
                continue
            other = params_codec.read_header(params_codec.encode(rows))
            assert other[0] != base[0] and other[2] == base[2], (i, k)
    for cut in (0, 10, len(data) // 2, len(data) - 2, len(data) - 1):
        with pytest.raises(ValueError):
            params_codec.read_header(data[:cut])
    flipped = data.replace(b"[7,8]", b"[7,9]")
    with pytest.raises(ValueError, match="digest"):
        params_codec.read_header(flipped)


def test_a_table_that_checks_but_does_not_decode_is_said(tmp_path):
    """A writer bug (a digest over columns no reader knows) is said: never a clean match."""
    a = make_run(tmp_path / "a", world_size=2, steps=2, n_params=4)
    b = make_run(tmp_path / "b", world_size=2, steps=2, n_params=4)
    p = b / "rank-00001" / "params.json"
    unclose(b, 1)  # as its writer wrote it (after close, the edit would be damage)
    data = p.read_bytes()
    body = data[params_codec._BODY:].replace(b'"dtype":{"all":"float32"}', b'"dtype":{"some":1}')
    p.write_bytes(params_codec.PREFIX + params_codec.xxhash.xxh3_128_hexdigest(body).encode()
                  + b'",' + body)
    d = diff_runs(a, b).to_dict()
    assert any("rank-00001/params.json: table unreadable" in x["message"] for x in d["problems"])
