"""Bad input and faults (issue 6): fuzzed readers, a full disk, runs that cannot be compared.

The readers must either parse or raise parity's own error type (ParityError), never anything
else: a traceback is a bug. A read that succeeds must also be right: the untouched rank reads
exactly as before, and a corrupted rank may only yield a clean ``match`` when it reads exactly as
the original did (a corruption that silently matched would be the worst bug this tool can have).
"""

import errno
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity import artifacts  # noqa: E402
from parity.artifacts import RankWriter, read_run, write_json_atomic  # noqa: E402
from parity.diff import diff_runs  # noqa: E402
from parity.errors import ArtifactError, ParityError  # noqa: E402
from parity.sweep.spec import load_spec  # noqa: E402
from tests.synth import make_run  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
RANK_FILES = ["meta.json", "params.json", "steps.jsonl", "hashes.bin", "buckets.jsonl"]


@pytest.fixture(scope="module")
def valid_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    return make_run(base / "a", world_size=2, steps=3, n_params=6)


def _mutate(src: Path, dst: Path, name: str, data: bytes) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    (dst / "rank-00001" / name).write_bytes(data)


def _same_rank(got, want, per_parameter: bool = True) -> bool:
    """Same parameter table, step records (roll-up digests), buckets and, with
    ``per_parameter``, per-parameter hashes."""
    if (got.params, got.steps, got.buckets) != (want.params, want.steps, want.buckets):
        return False
    for step in want.steps if per_parameter else ():
        for kind in ("param", "grad"):
            a, b = got.hashes(step, kind), want.hashes(step, kind)
            if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
                return False
    return True


_ORIGINAL: dict = {}


def _read_and_diff(ref: Path, run: Path) -> None:
    """Rank 1 of ``run`` is ``ref``'s, corrupted: parse or raise ParityError, and when it
    parses, say what the bytes say."""
    try:
        got = read_run(run)
        d = diff_runs(ref, run).to_dict()
    except ParityError:
        return
    want = _ORIGINAL.get(ref) or _ORIGINAL.setdefault(ref, read_run(ref))
    assert 0 in got.ranks and _same_rank(got.ranks[0], want.ranks[0]), "the untouched rank changed"
    order = d.get("order") or {}
    clean = (d["verdict"] == "match" and not d["incomplete"] and not d["problems"]
             and order.get("verdict") == "identical"
             and not any((order.get("rank_disagreements") or {}).values()))
    if clean:  # what a match compares: the table, the steps' roll-up digests, the buckets
        # (per-parameter hashes are read only to locate a divergence: equal roll-ups are equal
        # hashes, as written)
        assert 1 in got.ranks and _same_rank(got.ranks[1], want.ranks[1], False), (
            "a corrupted rank matched without a word: " + json.dumps(d)[:400])


@FUZZ
@given(name=st.sampled_from(RANK_FILES), cut=st.floats(0, 1), junk=st.binary(max_size=64))
def test_truncated_or_extended_artifacts_parse_or_raise_parity_errors(valid_run, tmp_path, name,
                                                                       cut, junk):
    data = (valid_run / "rank-00001" / name).read_bytes()
    _mutate(valid_run, tmp_path / "b", name, data[: int(len(data) * cut)] + junk)
    _read_and_diff(valid_run, tmp_path / "b")


@FUZZ
@given(name=st.sampled_from(RANK_FILES), data=st.binary(max_size=512))
def test_random_bytes_in_artifacts_parse_or_raise_parity_errors(valid_run, tmp_path, name, data):
    _mutate(valid_run, tmp_path / "b", name, data)
    _read_and_diff(valid_run, tmp_path / "b")


RANK_FILES_V1 = ["params.json", "steps.jsonl", "hashes.jsonl", "buckets.jsonl"]


@pytest.fixture(scope="module")
def valid_run_v1(tmp_path_factory):
    """A run as artifact schema 1 wrote it (tests/schema_v1.py): still read as strictly."""
    return make_run(tmp_path_factory.mktemp("fuzz1") / "a", world_size=2, steps=3, n_params=6,
                    schema=1)


@settings(FUZZ, max_examples=60)
@given(name=st.sampled_from(RANK_FILES_V1), cut=st.floats(0, 1), junk=st.binary(max_size=64))
def test_schema_1_artifacts_truncated_or_extended_parse_or_raise_parity_errors(
        valid_run_v1, tmp_path, name, cut, junk):
    data = (valid_run_v1 / "rank-00001" / name).read_bytes()
    _mutate(valid_run_v1, tmp_path / "b", name, data[: int(len(data) * cut)] + junk)
    _read_and_diff(valid_run_v1, tmp_path / "b")


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                        max_size=4),
                    max_leaves=12)


@FUZZ
@given(name=st.sampled_from(RANK_FILES), obj=JSON, keep_v=st.booleans())
def test_random_json_records_parse_or_raise_parity_errors(valid_run, tmp_path, name, obj, keep_v):
    if keep_v and isinstance(obj, dict):
        obj = {"v": 1, **obj}
    line = json.dumps(obj) + "\n"
    data = (valid_run / "rank-00001" / name).read_bytes()
    payload = data + line.encode() if name.endswith(".jsonl") else line.encode()
    _mutate(valid_run, tmp_path / "b", name, payload)
    _read_and_diff(valid_run, tmp_path / "b")


SPEC_WORDS = st.sampled_from(["name", "steps", "seed", "timeout", "nproc_per_node", "axes",
                              "reference", "candidate", "builtin", "args", "argv", "values",
                              "flags", "requires", "env", "launcher", "type", "{steps}",
                              "{batch_size}", "[axes.flash]", "[reference]", "=", "\n", "[",
                              "]", '"', "true", "1", "-1", "[[x]]", "{", "}"])


@FUZZ
@given(text=st.lists(SPEC_WORDS, max_size=40).map(" ".join))
def test_random_spec_text_loads_or_raises_parity_errors(tmp_path, text):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    try:
        load_spec(path)
    except ParityError:
        pass


@FUZZ
@given(data=st.binary(max_size=256))
def test_random_spec_bytes_load_or_raise_parity_errors(tmp_path, data):
    path = tmp_path / "spec.toml"
    path.write_bytes(data)
    try:
        load_spec(path)
    except ParityError:
        pass


# ------------------------------------------------------------------------------- disk full


class _FullDisk:
    """A file object whose writes fail as on a full disk."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_disk_full_mid_run_names_the_path_and_keeps_earlier_steps(tmp_path):
    w = RankWriter(tmp_path, 0, {"world_size": 1})
    w.write_params([{"fqn": "w", "shape": [2], "dtype": "float32"}])
    for step in range(3):
        w.write_step(step, b"\x01" * 16, loss=1.0)
    w._hashes._f = _FullDisk(w._hashes._f)  # the disk fills up
    with pytest.raises(ArtifactError) as e:
        w.write_step(3, b"\x02" * 16)
    assert "hashes.bin" in str(e.value) and "No space left" in str(e.value)
    run = read_run(tmp_path)
    assert sorted(run.ranks[0].steps) == [0, 1, 2]
    assert run.ranks[0].hashes(2).tobytes() == b"\x01" * 16


def test_disk_full_on_an_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "cell.json"
    write_json_atomic(path, {"v": 1, "status": "match"})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(artifacts.os, "fsync", full)
    with pytest.raises(ArtifactError) as e:
        write_json_atomic(path, {"v": 1, "status": "hash_mismatch"})
    assert str(path) in str(e.value)
    assert json.loads(path.read_text())["status"] == "match"
    assert [p.name for p in tmp_path.iterdir()] == ["cell.json"]  # no temporary left behind


# ------------------------------------------------------------------- runs that cannot be compared


def _set_hasher(run: Path, hasher: str, version: int | None = None) -> None:
    for meta in run.glob("rank-*/meta.json"):
        m = json.loads(meta.read_text())
        m.setdefault("capture", {})["hasher"] = hasher
        if version is not None:
            m["capture"]["device_digest_version"] = version
        meta.write_text(json.dumps(m))


def test_runs_with_different_hashers_are_refused(tmp_path):
    a = make_run(tmp_path / "a", world_size=2, steps=2, n_params=4)
    b = make_run(tmp_path / "b", world_size=2, steps=2, n_params=4)
    _set_hasher(a, "xxh3")
    _set_hasher(b, "device")
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    assert e.value.exit_code == 2 and "different hashers" in str(e.value)


def test_runs_with_different_device_digest_versions_are_refused(tmp_path):
    """Version 2 of the device digest (words for 1/2/4-byte dtypes, the finish on the device)
    gives other bytes than version 1; a run from before versions were recorded is version 1."""
    a = make_run(tmp_path / "a", world_size=2, steps=2, n_params=4)
    b = make_run(tmp_path / "b", world_size=2, steps=2, n_params=4)
    c = make_run(tmp_path / "c", world_size=2, steps=2, n_params=4)
    _set_hasher(a, "device")  # no version recorded: 1
    _set_hasher(b, "device", 2)
    _set_hasher(c, "device", 1)
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    assert e.value.exit_code == 2 and "device v1" in str(e.value) and "device v2" in str(e.value)
    assert diff_runs(a, c).verdict == "match"


def test_runs_with_different_world_sizes_or_parameters_name_the_difference(tmp_path):
    a = make_run(tmp_path / "a", world_size=2, steps=2, n_params=4)
    b = make_run(tmp_path / "b", world_size=4, steps=2, n_params=4)
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    assert e.value.exit_code == 2 and "world sizes differ" in str(e.value)
    c = make_run(tmp_path / "c", world_size=2, steps=2, n_params=5)
    with pytest.raises(ParityError) as e:
        diff_runs(a, c)
    assert e.value.exit_code == 2 and "layers.1" in str(e.value)


# --------------------------------------------------------------- a rank killed in a sweep cell


def test_sigkilled_rank_fails_the_cell_keeps_logs_and_diffs_the_steps_it_finished(tmp_path):
    """Candidate rank 1 SIGKILLs itself after optimizer step 2 of 4: the cell is failed, every
    rank's log is kept, and the steps both sides finished are diffed (verdict incomplete)."""
    import subprocess

    trainer = Path(__file__).resolve().parent / "trainers" / "plain_fsdp2.py"
    spec = tmp_path / "kill.toml"
    spec.write_text(f'''name = "kill"
steps = 4
nproc_per_node = 2
timeout = 240
[axes]
x = [1]
[reference]
argv = ["{trainer}"]
env = {{PT_STEPS = "4"}}
[candidate]
argv = ["{trainer}"]
env = {{PT_STEPS = "4", PT_KILL = "1:2"}}
''')
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "parity", "sweep", str(spec),
                           "--out", str(out)], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 3, proc.stderr[-2000:]
    cell = json.loads((out / "sweep.json").read_text())["cells"][0]
    assert cell["status"] == "failed"
    assert "candidate" in cell["reason"] and "diffed steps 0-2" in cell["reason"]
    assert cell["diff"]["verdict"] == "incomplete"
    logs = cell["sides"]["candidate"]["rank_logs"]
    assert {entry.get("rank") for entry in logs} >= {0, 1}
    for entry in logs:
        for key in ("stdout", "stderr"):
            if entry.get(key):
                assert (out / entry[key]).is_file()
