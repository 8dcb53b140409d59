"""Round 14b: a run resumed from a checkpoint against the uninterrupted run, ``parity diff
--align-steps`` (parity/diff/align.py). ``parity exec`` of tests/trainers/round14b.py (imports
nothing from parity; FSDP2 at 2 ranks on gloo, dropout, Adam, a LambdaLR, a DCP checkpoint after
step 2 with each rank's generator state beside it), whose ground truth (``R14B_SAVE``) is every
step's parameters, loss and lr, the parameters right after the load, the final model and
optimizer state.

Was (docs/reliability.md, "Round 14b"): steps compared by number only, so the resumed run FAILED
at step 0 whatever followed (round 12b said why, and that no option aligned them). Now
``--align-steps B+2`` (or ``auto``, where the digests prove it) compares B's step i with A's step
2+i through every reader; a resume that forgot the optimizer state, the scheduler or the RNG
state FAILS at the step the ground truth first differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from parity.artifacts import RankData, Run, read_run
from parity.diff import align
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, ParityError
from tests.real_jobs import diff_cli, run_ok, saved, trainer_runs, values_equal

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round14b.py")
TIMEOUT = 900
K = 2  # the full run's checkpoint step


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("round14b")
    ck = root / "ck.dcp"
    full = trainer_runs(root, {"full": {"R14B_STEPS": 4, "R14B_CKPT": ck, "R14B_CKPT_AT": K}},
                        TRAINER, "R14B_", timeout=TIMEOUT)
    run_ok(full, "full")
    resumed = {"R14B_START": K, "R14B_STEPS": 4 - K, "R14B_LOAD": ck}
    jobs = {"res": resumed, "res_opt": {**resumed, "R14B_SKIP": "opt"},
            "res_sched": {**resumed, "R14B_SKIP": "sched"},
            "res_rng": {**resumed, "R14B_SKIP": "rng"},
            "res_short": {**resumed, "R14B_STEPS": 1}}
    return {**full, **trainer_runs(root, jobs, TRAINER, "R14B_", timeout=TIMEOUT)}


def _truth(run: Path, rank: int = 0) -> dict:
    return saved(f"{run}.truth", rank)


def _first_differing(full: Path, res: Path) -> int | None:
    """Ground truth: the first global step whose parameters or loss differ on either rank
    (K: the loaded state itself differs)."""
    for r in (0, 1):
        x, y = _truth(full, r), _truth(res, r)
        if not values_equal(y["init"], x["params"][K - 1]):
            return K
    for i in range(len(_truth(res)["params"])):
        for r in (0, 1):
            x, y = _truth(full, r), _truth(res, r)
            if not (values_equal(y["params"][i], x["params"][K + i])
                    and values_equal(y["losses"][i], x["losses"][K + i])):
                return K + 1 + i
    return None


def _diff_exit(a: Path, b: Path, *extra: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "parity", "diff", str(a), str(b), *extra],
                       capture_output=True, text=True, timeout=TIMEOUT)
    return p.returncode, p.stderr.strip()


def test_a_right_resume_holds_when_aligned(runs):
    """The resumed run is the full run's steps 3-4 bitwise (ground truth). By number it FAILS at
    step 0 (the line names the option); aligned, every reader compares and it HOLDS: parameters,
    gradients, loss, RNG digests, the final state with optimizer state, the bucket layouts; A's
    steps 0-1 are said, not compared; the JSON says the alignment; the other way round (A+2)
    and ``auto`` alike."""
    full, res = run_ok(runs, "full"), run_ok(runs, "res")
    assert _first_differing(full, res) is None
    for r in (0, 1):
        assert values_equal(_truth(res, r)["opt"], _truth(full, r)["opt"])
    rc, line, _ = diff_cli(full, res, timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "from step 0" in line and "--align-steps B+2" in line, line
    for how in ("B+2", "auto"):
        rc, line, js = diff_cli(full, res, "--align-steps", how, timeout=TIMEOUT)
        assert rc == EXIT_OK, line
        assert f"steps aligned (--align-steps {how}" in line, line
        assert "B's step i against A's step 2+i, numbered as A's" in line, line
        assert "(param, grad, loss, final state with optimizer state)" in line, line
        assert "bucket layouts identical" in line, line
        assert "not compared: A's step(s) 0-1 (before B's step 0" in line, line
        assert js["steps_compared"] == [2, 3, 4] and js["incomplete"] == []
        assert js["align"]["side"] == "b" and js["align"]["offset"] == K
        assert js["final_state"]["compared"] and js["final_state"]["after_step"] == 4
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(js, json.loads((HERE.parent / "parity" / "schemas" /
                                        "diff.schema.json").read_text()))
    rc, line, js = diff_cli(res, full, "--align-steps", "A+2", timeout=TIMEOUT)
    assert rc == EXIT_OK and "A's step i against B's step 2+i, numbered as B's" in line, line
    rc, line, js = diff_cli(res, full, "--align-steps", "auto", timeout=TIMEOUT)
    assert rc == EXIT_OK and js["align"]["side"] == "a", line


@pytest.mark.parametrize("name, step, label", [
    # Adam's moments and step count left as get_state_dict's initialising step made them
    # (and the group's lr: the LambdaLR's restored, the optimizer's initial one; round 14c)
    ("res_opt", 3, "(gradients equal, parameters differ; optimizer lr differs from step 3)"),
    # the LambdaLR at last_epoch 0: step 3 uses the lr the optimizer state restored, step 4 not
    ("res_sched", 4, "(gradients equal, parameters differ; optimizer lr differs from step 4)"),
    # the generator as seeded: other dropout masks from the first resumed step
    ("res_rng", 3, "RNG state differs from step 3"),
])
def test_a_wrong_resume_fails_at_the_aligned_step(runs, name, step, label):
    full, res = run_ok(runs, "full"), run_ok(runs, name)
    assert _first_differing(full, res) == step
    rc, line, js = diff_cli(full, res, "--align-steps", "B+2", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and f"hash mismatch from step {step} on rank 0, 1" in line, line
    assert label in line and "steps aligned (--align-steps B+2)" in line, line
    assert js["first_divergent_step"] == step
    said = "param_group numbers (lr, betas, eps, weight decay) of l0.weight"
    assert (said in js["first_divergence"]["explanation"]) == (name == "res_sched"), js
    # the loaded state itself is right: auto proves the offset
    rc, line, _ = diff_cli(full, res, "--align-steps", "auto", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and f"from step {step} " in line, line


def test_steps_one_side_lacks_after_the_anchor_are_incomplete(runs):
    """A resumed run of one step against the 4-step run: steps 2-3 compared and equal, A's step
    4 has no counterpart: incomplete (never a match), and the final states (after different
    steps) not compared."""
    full, res = run_ok(runs, "full"), run_ok(runs, "res_short")
    rc, line, js = diff_cli(full, res, "--align-steps", "B+2", timeout=TIMEOUT)
    assert rc == EXIT_INCOMPLETE, line
    assert "hashes bitwise identical where both sides recorded: steps 2-3" in line, line
    assert "B lacks 2 (rank, step) record(s) that A has: step(s) 4" in line, line
    assert not js["final_state"]["compared"]


def test_alignment_that_cannot_be_made_exits_2(runs):
    """Bad input: one line, exit 2, before any verdict."""
    full, res = run_ok(runs, "full"), run_ok(runs, "res")
    for how, words in (("B+5", "beyond the steps of A (its last step is 4)"),
                       ("A+3", "beyond the steps of B (its last step is 2)"),
                       ("B-1", "a negative offset; say the other side (A+1"),
                       ("2", "expected none | auto | B+K | A+K")):
        rc, err = _diff_exit(full, res, "--align-steps", how)
        assert rc == EXIT_USAGE and words in err and len(err.splitlines()) == 1, (how, err)
    # every pair of these runs starts from a proven state: ``auto`` with nothing proven is
    # test_auto_needs_a_proof_on_every_rank below


# ------------------------------------------------------------------ the alignment alone


def _rank(steps: dict, rank: int = 0) -> RankData:
    return RankData(rank, Path("."), {}, {s: {"step": s, **rec} for s, rec in steps.items()},
                    [{"step": 1, "source": "fsdp2"}])


def _run(*ranks: RankData) -> Run:
    return Run(Path("."), None, {r.rank: r for r in ranks}, [])


def _steps(*digests: str) -> dict:
    return {i: {"v": 2, "param_digest": d, "grad_digest": None if i == 0 else f"g{d}",
                "loss": None if i == 0 else 1.0, "rng": None if i == 0 else {"cpu": "r"}}
            for i, d in enumerate(digests)}


def test_parse_spellings():
    assert align.parse(None) == ("none", None, 0)
    assert align.parse(" Auto ") == ("auto", None, 0)
    assert align.parse("b+3") == ("B+3", "b", 3)
    assert align.parse("A + 1") == ("A+1", "a", 1)
    assert align.parse("B+0") == ("B+0", None, 0)
    for bad in ("B-2", "C+1", "+2", "B+", "B+1.5", "3"):
        with pytest.raises(ParityError) as e:
            align.parse(bad)
        assert e.value.exit_code == EXIT_USAGE


def test_auto_needs_a_proof_on_every_rank():
    a = _run(_rank(_steps("p0", "p1", "p2", "p3")), _rank(_steps("q0", "q1", "q2", "q3"), 1))
    b = _run(_rank(_steps("p2", "x", "y")), _rank(_steps("q2", "x1", "y1"), 1))
    al = align.resolve("auto", a, b)
    assert (al.side, al.offset, al.before) == ("b", 2, [0, 1])
    assert align.resolve("auto", b, a).side == "a"
    # one rank disagrees (q1, not q2): nothing proven
    b1 = _run(_rank(_steps("p2", "x")), _rank(_steps("q1", "x1"), 1))
    al_none = align.resolve("auto", a, _run(_rank(_steps("p0")), _rank(_steps("q0"), 1)))
    assert al_none.side is None and "by number" in al_none.words()  # step 0 equal everywhere
    with pytest.raises(ParityError, match="no offset is proven") as e:
        align.resolve("auto", a, b1)
    assert e.value.exit_code == EXIT_USAGE
    # a step 0 found at two steps of the other side (parameters that did not move): not proven
    flat = _run(_rank(_steps("p0", "p1", "p1")), _rank(_steps("q0", "q1", "q1"), 1))
    with pytest.raises(ParityError, match="no offset is proven"):
        align.resolve("auto", flat, _run(_rank(_steps("p1")), _rank(_steps("q1"), 1)))


def test_apply_renumbers_one_side_and_cuts_the_other_at_the_anchor():
    a = _run(_rank(_steps("p0", "p1", "p2", "p3")))
    b = _run(_rank(_steps("p2", "x")))
    b.ranks[0].final = {"step": "final", "after_step": 1}
    al = align.resolve("B+2", a, b)
    va, vb = align.apply(al, a, b)
    assert sorted(va.ranks[0].steps) == [2, 3] and sorted(vb.ranks[0].steps) == [2, 3]
    anchor = va.ranks[0].steps[2]
    assert anchor["param_digest"] == "p2" and anchor["grad_digest"] is None
    assert anchor["loss"] is None and "rng" not in anchor
    assert va.ranks[0].steps[3] is a.ranks[0].steps[3]  # the rest as read
    assert vb.ranks[0].steps[3]["step"] == 3 and vb.ranks[0].steps[3]["param_digest"] == "x"
    assert vb.ranks[0].final["after_step"] == 3 and vb.ranks[0].buckets[0]["step"] == 3
    assert b.ranks[0].steps[1]["step"] == 1 and b.ranks[0].final["after_step"] == 1  # untouched
    assert al.before_note().startswith("A's step(s) 0-1 (before B's step 0, which is A's step 2")
    assert align.apply(align.Alignment(), a, b) == (a, b)
    zero = align.resolve("B+0", a, b)
    assert zero.side is None and zero.words() == "steps aligned by number (--align-steps B+0)"
    assert align.resolve("none", a, b).words() == "" and align.Alignment().to_dict() is None


def test_shifted_hash_records_read_at_their_new_step(runs):
    """The resumed side's hash records carry their recorded step; read through the view, each
    is found at its step plus the offset, bytes unchanged."""
    full, res = read_run(run_ok(runs, "full")), read_run(run_ok(runs, "res"))
    al = align.resolve("B+2", full, res)
    _, vb = align.apply(al, full, res)
    for s in (0, 1, 2):
        got, want = vb.ranks[1].hashes(s + K), res.ranks[1].hashes(s)
        assert got is not None and (got == want).all()
    assert (vb.ranks[1].hashes(0, "final") == res.ranks[1].hashes(0, "final")).all()
    assert vb.ranks[1].figures(K + 1, "grad") is not None
    assert not vb.ranks[1].problems
