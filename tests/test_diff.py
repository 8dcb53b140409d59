"""`parity diff` hash comparison, input cases and exit codes, on synthetic runs (tests/synth.py)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synth import default_fqns, make_run, unclose  # noqa: E402

from parity import params_codec  # noqa: E402
from parity.diff import diff_runs, load_diff_json  # noqa: E402
from parity.diff.result import from_dict  # noqa: E402
from parity.errors import ParityError  # noqa: E402

FQNS = default_fqns(8)  # layers.{0,1}.{attention.wq,attention.wk,attention.wv,attention.wo}.weight
WK0 = "layers.0.attention.wk.weight"


def pair(tmp_path: Path, a: dict | None = None, b: dict | None = None, **common):
    base = {"world_size": 2, "steps": 4, "n_params": 8, **common}
    ra = make_run(tmp_path / "a", **{**base, **(a or {})})
    rb = make_run(tmp_path / "b", **{**base, **(b or {})})
    return ra, rb


# ------------------------------------------------------------------------------------- match


def test_identical_runs_match(tmp_path):
    a, b = pair(tmp_path)
    r = diff_runs(a, b)
    assert r.verdict == "match"
    assert r.first_divergent_step is None and r.first_divergence is None
    assert r.divergent == [] and r.per_step == []
    assert r.steps_compared == [0, 1, 2, 3, 4]
    assert r.ranks_compared == [0, 1] and r.world_size == 2
    assert r.params_compared == 8 and r.kinds_compared == ["param", "grad"]
    assert r.loss.captured and r.loss.first_divergent_step is None
    assert r.incomplete == [] and r.problems == []
    assert r.order.verdict == "identical"
    assert {p: r.exit_code(p) for p in ("hash", "order-only", "any")} == {
        "hash": 0, "order-only": 0, "any": 0}
    assert r.stats["cells_drilled"] == 0  # equal roll-ups: no hash line read


def test_same_run_against_itself(tmp_path):
    a = make_run(tmp_path / "a")
    assert diff_runs(a, a).verdict == "incomplete"  # the same directory: said


def test_a_copy_of_a_run_is_one_recording_not_two(tmp_path):
    """Found by a tester: `cp -r c ccopy; parity diff c ccopy` held (exit 0), a hard-linked
    copy too; only `parity diff c c` was caught. Every rank written by the same process (host,
    pid, start time in meta.json) is one recording: incomplete, said."""
    import json
    import os
    import shutil

    a = make_run(tmp_path / "a")
    for how in ("copy", "hardlink"):
        b = tmp_path / how
        shutil.copytree(a, b, **({"copy_function": os.link} if how == "hardlink" else {}))
        r = diff_runs(a, b)
        assert r.verdict == "incomplete" and r.exit_code("hash") == 3, how
        assert "A and B are one recording" in r.incomplete[0]
        assert "INCOMPLETE" in r.judge("hash").line()
    # the same numbers recorded by another process: a real pair
    other = tmp_path / "other"
    shutil.copytree(a, other)
    for m in other.glob("rank-*/meta.json"):
        meta = json.loads(m.read_text())
        meta["pid"] += 1
        m.write_text(json.dumps(meta))
    assert diff_runs(a, other).verdict == "match"
    assert diff_runs(a, make_run(tmp_path / "twin")).verdict == "match"  # another recording


def test_storage_order_differs_still_matches(tmp_path):
    """B stores its parameters in another order: roll-ups differ, per-parameter hashes do not."""
    a, b = pair(tmp_path, b={"param_order": "shuffled"})
    r = diff_runs(a, b)
    assert r.verdict == "match"
    assert r.stats["cells_drilled"] > 0


# --------------------------------------------------------------------------------- divergence


def test_grad_divergence_reported_at_its_step_with_rank_and_buckets(tmp_path):
    a, b = pair(tmp_path, b={"diverge_at": 2, "diverge_rank": 1, "diverge_param": WK0})
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch"
    assert r.first_divergent_step == 2
    fd = r.first_divergence
    assert fd.origin == "backward" and fd.grad_before_param
    assert fd.previous_step == 1 and fd.ranks == [1] and fd.params == 1 and fd.grads == 1
    assert fd.loss_differs is False
    assert [(d.step, d.fqn, d.kind, d.ranks) for d in r.divergent] == [
        (2, WK0, "grad", [1]), (2, WK0, "param", [1])]
    # linking: the bucket and byte offset of the parameter on both sides
    links = r.divergent[0].buckets
    assert links["reduce_scatter"]["a"]["offset"] == links["reduce_scatter"]["b"]["offset"]
    assert links["all_gather"]["a"]["group"] == "layers.0"
    assert links["reduce_scatter"]["a"]["index"] == 1  # backward: the last layer's bucket first
    assert links["reduce_scatter"]["a"]["position"] == 1
    # after the first step everything differs (propagation)
    assert [(c.step, c.params, c.grads, c.ranks, c.exact) for c in r.per_step] == [
        (2, 1, 1, 1, True), (3, 8, 8, 2, True), (4, 8, 8, 2, True)]
    assert r.loss.first_divergent_step == 3
    assert r.exit_code("hash") == 1 and r.exit_code("any") == 1 and r.exit_code("order-only") == 0


def test_param_divergence_points_at_the_optimizer(tmp_path):
    a, b = pair(tmp_path, b={"diverge_at": 3, "diverge_rank": 0, "diverge_param": [1, 5],
                             "kind": "param"})
    r = diff_runs(a, b)
    fd = r.first_divergence
    assert r.first_divergent_step == 3 and fd.origin == "optimizer" and not fd.grad_before_param
    assert fd.grads == 0 and fd.params == 2
    assert [(d.fqn, d.kind, d.ranks) for d in r.divergent] == [
        (FQNS[1], "param", [0]), (FQNS[5], "param", [0])]


def test_loss_divergence_points_at_the_forward(tmp_path):
    a, b = pair(tmp_path, b={"diverge_at": 2, "diverge_rank": 1, "kind": "loss"})
    r = diff_runs(a, b)
    assert r.first_divergent_step == 2 and r.loss.first_divergent_step == 2
    assert r.first_divergence.origin == "forward" and r.first_divergence.loss_differs
    grads = [d for d in r.divergent if d.kind == "grad"]
    assert len(grads) == 8 and all(d.ranks == [1] for d in grads)


def test_init_divergence(tmp_path):
    a, b = pair(tmp_path, b={"diverge_at": 0, "diverge_rank": "all", "diverge_param": 0,
                             "kind": "param"})
    r = diff_runs(a, b)
    assert r.first_divergent_step == 0 and r.first_divergence.origin == "init"
    assert r.divergent[0].ranks == [0, 1]


def test_divergence_that_heals_counts_zero_afterwards(tmp_path):
    a, b = pair(tmp_path, b={"diverge_at": 2, "diverge_rank": 0, "diverge_param": 3,
                             "propagate": False})
    r = diff_runs(a, b)
    assert [(c.step, c.params, c.grads, c.ranks) for c in r.per_step] == [
        (2, 0, 1, 1), (3, 0, 0, 0), (4, 0, 0, 0)]
    assert r.loss.first_divergent_step is None


def test_divergence_found_through_a_different_storage_order(tmp_path):
    a, b = pair(tmp_path, b={"param_order": "reversed", "diverge_at": 1, "diverge_rank": 1,
                             "diverge_param": 6})
    r = diff_runs(a, b)
    assert r.first_divergent_step == 1
    assert {(d.fqn, d.kind) for d in r.divergent} == {(FQNS[6], "grad"), (FQNS[6], "param")}


def test_many_ranks_divergence_lists_every_rank(tmp_path):
    a, b = pair(tmp_path, world_size=8, b={"diverge_at": 1, "diverge_rank": [2, 5, 7],
                                            "diverge_param": 0, "propagate": False})
    r = diff_runs(a, b)
    assert r.divergent[0].ranks == [2, 5, 7]


def test_drill_down_after_the_first_step_is_bounded(tmp_path):
    """Later steps stop drilling once every parameter is known to differ: an early divergence
    does not read every rank's hashes of every later step."""
    a, b = pair(tmp_path, world_size=16, steps=12, n_params=40,
                b={"diverge_at": 2, "diverge_rank": 3, "diverge_param": 7})
    r = diff_runs(a, b)
    assert r.first_divergent_step == 2
    assert [c.params for c in r.per_step[1:]] == [40] * 10
    assert all(c.ranks == 16 and c.exact for c in r.per_step[1:])
    assert r.stats["cells_drilled"] <= 2 + 2 * 10  # vs 2 + 16 * 2 * 10 without saturation


def test_count_budget_marks_counts_inexact(tmp_path):
    a = make_run(tmp_path / "a", world_size=4, steps=4, n_params=8)
    b = make_run(tmp_path / "b", world_size=4, steps=4, n_params=8, diverge_at=1,
                 diverge_rank="all", diverge_param=0)
    r = diff_runs(a, b, count_budget=0)
    assert r.per_step[0].exact  # the first divergent step is always complete
    assert all(not c.exact and c.params is None and c.ranks == 4 for c in r.per_step[1:])


# ------------------------------------------------------------------------- input problems


def test_different_world_sizes_is_a_usage_error(tmp_path):
    a = make_run(tmp_path / "a", world_size=2)
    b = make_run(tmp_path / "b", world_size=4)
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    assert e.value.exit_code == 2 and "world sizes differ" in str(e.value)


def test_different_parameter_sets_name_the_parameters(tmp_path):
    a = make_run(tmp_path / "a", n_params=8)
    b = make_run(tmp_path / "b", fqns=FQNS[:6] + ["extra.one", "extra.two"])
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    msg = str(e.value)
    assert e.value.exit_code == 2
    assert "2 only in A" in msg and FQNS[6] in msg and "2 only in B" in msg and "extra.one" in msg


def test_parameter_mismatch_allowed_compares_the_common_ones(tmp_path):
    a = make_run(tmp_path / "a", n_params=8)
    b = make_run(tmp_path / "b", fqns=FQNS[:6] + ["extra.one", "extra.two"])
    r = diff_runs(a, b, allow_param_mismatch=True)
    assert r.params_only_in_a == FQNS[6:] and r.params_only_in_b == ["extra.one", "extra.two"]
    assert r.params_compared == 6
    assert r.verdict == "incomplete" and "parameter sets differ" in r.incomplete[0]
    assert r.exit_code() == 3


def test_many_missing_names_are_abbreviated(tmp_path):
    a = make_run(tmp_path / "a", n_params=40)
    b = make_run(tmp_path / "b", n_params=8)
    with pytest.raises(ParityError) as e:
        diff_runs(a, b)
    assert "32 only in A" in str(e.value) and "and 27 more" in str(e.value)


def test_fewer_steps_compares_the_common_prefix(tmp_path):
    a, b = pair(tmp_path, steps=6, b={"stop_after": 3})
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.steps_compared == [0, 1, 2, 3]
    assert r.b.steps == [0, 1, 2, 3] and r.a.steps == list(range(7))
    assert "B lacks" in r.incomplete[0] and "4-6" in r.incomplete[0]
    assert r.exit_code("hash") == 3 and r.exit_code("any") == 3


def test_mismatch_in_the_common_prefix_wins_over_incomplete(tmp_path):
    a, b = pair(tmp_path, steps=6, b={"stop_after": 3, "diverge_at": 2})
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.incomplete
    assert r.exit_code("hash") == 1
    assert r.exit_code("order-only") == 3  # no order failure; the data is still incomplete


def test_missing_ranks_are_incomplete(tmp_path):
    a, b = pair(tmp_path, world_size=4, b={"missing_ranks": [1, 3]})
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.ranks_compared == [0, 2]
    assert r.b.missing_ranks == [1, 3]
    assert any("B is missing rank(s) 1, 3" in m for m in r.incomplete)
    assert r.exit_code() == 3


def test_one_rank_stopped_early(tmp_path):
    a, b = pair(tmp_path, b={"stop_after": {1: 2}})
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and "on 1 rank(s) (first: rank 1)" in r.incomplete[0]


def test_truncated_lines_are_warnings_and_the_rest_is_used(tmp_path):
    a, b = pair(tmp_path, b={"torn_tail": [0, 1]})
    r = diff_runs(a, b)
    assert r.verdict == "match" and r.exit_code() == 0
    msgs = [p.message for p in r.problems if p.side == "b"]
    assert any("rank-00000/steps.jsonl: last line truncated" in m for m in msgs)
    assert any("rank-00001/steps.jsonl: last line truncated" in m for m in msgs)
    # hashes are read by offset, only where needed: a torn tail is never touched


@pytest.mark.parametrize("schema", [1, 2])
def test_corrupt_hash_record_is_incomplete_not_a_crash(tmp_path, schema):
    a, b = pair(tmp_path, b={"diverge_at": 2, "diverge_rank": 0, "propagate": False},
                schema=schema)
    path = b / "rank-00000" / ("hashes.jsonl" if schema == 1 else "hashes.bin")
    steps = [json.loads(x) for x in (b / "rank-00000" / "steps.jsonl").read_text().splitlines()]
    off = next(s["grad_offset"] for s in steps if s["step"] == 2)
    data = path.read_bytes()
    path.write_bytes(data[:off] + b"#" + data[off + 1:])  # break that record's start
    r = diff_runs(a, b)
    assert any("could not be read" in m for m in r.incomplete)
    assert any("step 2 grad record unreadable" in p.message for p in r.problems)
    assert r.verdict == "incomplete" and r.exit_code() == 3


@pytest.mark.parametrize("schema", [1, 2])
def test_a_flipped_hash_is_corruption_not_a_divergence(tmp_path, schema):
    """A record whose bytes no longer have the roll-up steps.jsonl recorded is not compared
    (incomplete): it is never reported as the parameter that diverged."""
    a, b = pair(tmp_path, b={"diverge_at": 2, "diverge_rank": 0, "diverge_param": 1,
                             "propagate": False}, schema=schema)
    path = b / "rank-00000" / ("hashes.jsonl" if schema == 1 else "hashes.bin")
    steps = [json.loads(x) for x in (b / "rank-00000" / "steps.jsonl").read_text().splitlines()]
    off = next(s["grad_offset"] for s in steps if s["step"] == 2)
    data = bytearray(path.read_bytes())
    # the last hash of the record (parameter 7, not the divergent one): its last byte or hex digit
    end = data.index(b"\n", off) - 3 if schema == 1 else off + 20 + 8 * 16 - 1
    data[end] = ord("0") if data[end] != ord("0") else ord("1")
    path.write_bytes(bytes(data))
    r = diff_runs(a, b)
    assert any("do not have the roll-up" in p.message for p in r.problems)
    assert r.verdict == "incomplete" and r.exit_code() == 3
    assert all(d.fqn != FQNS[7] for d in r.divergent)


def test_failed_job_is_incomplete_even_when_every_step_matches(tmp_path):
    # issue 13: a job that exited non-zero is not a clean match (its exit code is its status)
    a, b = pair(tmp_path, b={"status": "error"})
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code() == 3
    assert r.incomplete[0].startswith("B failed: ")
    assert any("did not end cleanly" in p.message for p in r.problems)


def test_grads_on_one_side_only(tmp_path):
    a, b = pair(tmp_path, b={"grads": False})
    r = diff_runs(a, b)
    # issue 21: what one side recorded and the other did not is not compared: never a clean 0
    assert r.verdict == "incomplete" and r.kinds_compared == ["param"] and r.exit_code() == 3
    assert any(m.startswith("gradients recorded by A only") for m in r.incomplete)
    assert "not compared: " in r.judge().line() and "gradients recorded by A only" in \
        r.judge().line()


def test_no_loss_captured(tmp_path):
    a, b = pair(tmp_path, loss=False)
    r = diff_runs(a, b)
    assert not r.loss.captured and r.loss.steps == []


def test_rank_without_parameter_table(tmp_path):
    a, b = pair(tmp_path)
    (b / "rank-00001" / "params.json").unlink()
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.ranks_compared == [0]
    assert any("no parameter table" in p.message for p in r.problems)


@pytest.mark.parametrize("schemas", [(1, 1), (2, 2), (1, 2)])
def test_shape_differences_are_reported(tmp_path, schemas):
    a, b = pair(tmp_path, a={"schema": schemas[0]}, b={"schema": schemas[1]})
    p = b / "rank-00000" / "params.json"
    if schemas[1] == 1:
        obj = json.loads(p.read_text())
        obj["params"][2]["shape"] = [99, 16]
        p.write_text(json.dumps(obj))
    else:  # rewritten as the writer would have written it (a consistent digest)
        unclose(b, 0)  # else an edit after close: damage, not compared
        rows = params_codec.decode(p.read_bytes())
        rows[2]["shape"] = [99, 16]
        p.write_bytes(params_codec.encode(rows))
    r = diff_runs(a, b)
    assert any(f"rank 0 {FQNS[2]}: shape/dtype [3, 16] float32 in A, [99, 16]" in x.message
               for x in r.problems)


def test_table_edited_without_its_digest_is_not_compared(tmp_path):
    a, b = pair(tmp_path)
    p = b / "rank-00001" / "params.json"
    # an edit in the clock tick its writer closed the file in would keep the recorded times on
    # kernels without fine-grained file times (docs/artifacts.md, closed_files)
    time.sleep(0.1)
    p.write_bytes(p.read_bytes().replace(b"[3,16]", b"[9,16]", 1))
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.ranks_compared == [0]
    assert any("rank-00001/params.json: its digest does not match" in x.message
               for x in r.problems)


@pytest.mark.parametrize("setup", ["missing", "file", "empty", "foreign", "no_ranks_run"])
def test_bad_directories_are_usage_errors(tmp_path, setup):
    good = make_run(tmp_path / "good")
    bad = tmp_path / "bad"
    if setup == "file":
        bad.write_text("x")
    elif setup == "empty":
        bad.mkdir()
    elif setup == "foreign":
        (bad / "src").mkdir(parents=True)
        (bad / "README").write_text("hello")
    elif setup == "no_ranks_run":
        bad.mkdir()
        (bad / "run.json").write_text(json.dumps({"v": 1, "status": "failed", "exit_code": 1}))
    for args in ((good, bad), (bad, good)):
        with pytest.raises(ParityError) as e:
            diff_runs(*args)
        assert e.value.exit_code == 2


def test_unknown_fail_on_policy(tmp_path):
    a, b = pair(tmp_path)
    with pytest.raises(ParityError):
        diff_runs(a, b).exit_code("everything")


# ------------------------------------------------------------------------------------- CLI


def run_cli(args, capsys):
    from parity import cli

    with pytest.raises(SystemExit) as e:
        cli.main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_exit_codes_and_json(tmp_path, capsys):
    a, b = pair(tmp_path, b={"diverge_at": 2, "bucket_layout": "graph",
                             "bucket_order": "reversed-rs"})
    out = tmp_path / "d.json"
    code, stdout, _ = run_cli(["diff", str(a), str(b), "--json", str(out)], capsys)
    assert code == 1 and "HASH MISMATCH" in stdout
    assert stdout.startswith("PARITY FAILS under --fail-on hash (exit 1): hash mismatch from step 2")
    assert load_diff_json(out)["first_divergent_step"] == 2
    assert load_diff_json(out)["status"] == "hash_mismatch"
    assert not list(tmp_path.glob(".d.json*"))  # atomic: no temporary left behind
    assert run_cli(["diff", str(a), str(b), "--fail-on", "order-only"], capsys)[0] == 1
    c = make_run(tmp_path / "c", world_size=2, steps=4, n_params=8, bucket_layout="graph",
                 bucket_order="reversed-rs")
    code, stdout, _ = run_cli(["diff", str(a), str(c)], capsys)
    assert code == 0 and stdout.startswith("PARITY HOLDS under --fail-on hash (exit 0)")
    assert "tolerated: bucket" in stdout.splitlines()[0]
    code, stdout, _ = run_cli(["diff", str(a), str(c), "--fail-on", "any"], capsys)
    # never HOLDS with a non-zero exit: the line names what failed it
    assert code == 1 and stdout.startswith("PARITY FAILS under --fail-on any (exit 1): bucket")
    assert "HOLDS" not in stdout
    assert run_cli(["diff", str(a), str(c), "--fail-on", "order-only"], capsys)[0] == 1
    code, _, stderr = run_cli(["diff", str(a), str(c), "--fail-on", "order"], capsys)
    assert code == 2 and "order-only" in stderr


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    a = make_run(tmp_path / "a")
    code, stdout, stderr = run_cli(["diff", str(a), str(tmp_path / "nope")], capsys)
    assert code == 2
    assert stderr.startswith("parity: error:") and len(stderr.strip().splitlines()) == 1
    assert "Traceback" not in stderr + stdout


def test_cli_incomplete_exit_3(tmp_path, capsys):
    a, b = pair(tmp_path, b={"stop_after": 2})
    code, stdout, _ = run_cli(["diff", str(a), str(b)], capsys)
    assert code == 3 and stdout.startswith("PARITY INCOMPLETE under --fail-on hash (exit 3)")


def test_load_diff_json_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"schema_version": 99}')
    with pytest.raises(ParityError):
        load_diff_json(p)


def test_loss_only_divergence(tmp_path):
    a, b = pair(tmp_path, b={"diverge_at": 2, "diverge_rank": 0, "kind": "loss",
                             "propagate": False})
    r = diff_runs(a, b)
    assert r.verdict == "hash_mismatch" and r.first_divergent_step == 2
    assert r.first_divergence.origin == "loss" and r.divergent == []
    assert r.loss.steps[1].equal is False and r.loss.steps[1].ranks_differing == 1


# ------------------------------------------- what neither side recorded, and records never closed


def test_what_neither_side_recorded_is_said_on_the_verdict_line(tmp_path):
    """--every on both sides leaves steps neither recorded; --no-grads and a trainer that never
    calls backward() on a loss leave kinds neither recorded: a match does not cover them, so
    the line says each (the exit stays 0: both sides chose it alike)."""
    a, b = pair(tmp_path, steps=6, every=2)
    r = diff_runs(a, b)
    assert r.verdict == "match" and r.exit_code() == 0
    gaps = [m for m in r.not_recorded if m.startswith("step(s) ")]
    assert gaps and "sampled every 2 step(s)" in gaps[0], r.not_recorded
    line = r.judge().line()
    assert "not compared: " in line and gaps[0] in line
    assert "not_recorded" in r.to_dict() and from_dict(r.to_dict()).not_recorded == \
        r.not_recorded
    a, b = pair(tmp_path / "bare", grads=False, loss=False)
    r = diff_runs(a, b)
    assert r.verdict == "match" and r.exit_code() == 0
    assert r.not_recorded == ["gradients (neither side recorded them)",
                              "the loss (neither side recorded it: no backward() of a loss "
                              "tensor)"]
    assert all(m in r.judge().line() for m in r.not_recorded)
    a, b = pair(tmp_path / "full")
    assert diff_runs(a, b).not_recorded == []


def test_a_rank_whose_records_were_never_closed_is_incomplete(tmp_path):
    """os._exit after the last step (or a signal the launcher did not report): the job exited
    0, but the rank's meta.json still says running. A step --every skipped and the final state
    would have been written at exit: what ran after the last record is not known."""
    a, b = pair(tmp_path)
    meta = b / "rank-00001" / "meta.json"
    m = json.loads(meta.read_text())
    m["status"] = "running"
    meta.write_text(json.dumps(m))
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code() == 3
    assert any(x.startswith("B rank(s) 1 never closed their records") for x in r.incomplete), \
        r.incomplete
    assert "never closed" in r.judge().line()


def test_a_rank_folder_outside_the_world_size_with_data_is_never_a_clean_match(tmp_path):
    """Found by a tester: `cp -r r2/rank-00001 r2/rank-00002` (world size 2) held (exit 0) with
    a warning "outside the world size ... ignored": recorded data not compared is incomplete."""
    import shutil

    a, b = pair(tmp_path)
    shutil.copytree(b / "rank-00001", b / "rank-00002")
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code("hash") == 3
    assert any("B: rank directories 2 are outside the world size 2" in m for m in r.incomplete)
    assert r.ranks_compared == [0, 1]
    assert "INCOMPLETE" in r.judge("hash").line()
    shutil.rmtree(b / "rank-00002")
    (b / "rank-00002").mkdir()  # an empty one: incomplete too (as it was)
    assert diff_runs(a, b).exit_code("hash") == 3


@pytest.mark.parametrize("capture", ["x", [1], 3])
def test_a_meta_json_capture_that_is_not_an_object_is_damage_not_a_crash(tmp_path, capture):
    """Found by a tester: `"capture": "x"` in a rank's meta.json crashed the diff with an
    AttributeError (engine._hashers). It is damage: said, incomplete."""
    a, b = pair(tmp_path)
    for m in b.glob("rank-*/meta.json"):
        meta = json.loads(m.read_text())
        meta["capture"] = capture
        m.write_text(json.dumps(meta))
    r = diff_runs(a, b)
    assert r.verdict == "incomplete" and r.exit_code("hash") == 3
    assert any("rank(s) 0-1 have a meta.json whose capture is a" in m for m in r.incomplete)
    r.judge("hash").line()
    r.to_dict()


def test_gradients_on_one_side_only_name_the_option_that_left_them_out(tmp_path):
    a, b = pair(tmp_path, b={"grads": False})
    r = diff_runs(a, b)
    assert any(m.endswith("; B captured with --no-grads") for m in r.incomplete), r.incomplete
