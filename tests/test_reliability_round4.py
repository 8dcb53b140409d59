"""Issue 32 (verdicts that cannot be fooled, round 4), items 2-6, with real processes: `parity
exec` of tests/trainers/round4.py (which imports nothing from parity), then the real CLI.

- the state the trainer ends with: an edit after the only step() is the final state's, named;
  with three steps, an edit after step 1 is attributed to the interval, not to step 2's forward;
- a scaled loss (torch.amp.GradScaler on CPU): different scales hold; a skipped step is named;
- the numerics fingerprint from the compiled regions: mode="max-autotune-no-cudagraphs" named;
- damage always said: hashes.bin rows swapped, cut by 7 bytes, one byte flipped; params.json
  names edited with its digest recomputed; meta.json deleted: never exit 0;
- exit codes and wording: a collective --emulate-nccl refuses exits 2 from `parity exec`; two
  optimizers stepped back to back count one step; a shared reference's owner keeps its link
  after `sweep --resume`.

The plain-python jobs start together (module fixture, three at a time); the torchrun, compile
and sweep cases run in their own tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from parity import params_codec
from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE
from tests.real_jobs import diff_cli, knob_env, run_ok, run_table

HERE = Path(__file__).resolve().parent
TRAINER = str(HERE / "trainers" / "round4.py")
PARITY = [sys.executable, "-m", "parity"]
TIMEOUT = 900


def _env(**knobs):
    return knob_env("R4_", **knobs)


def _start(out, *command, opts=(), **knobs):
    argv = [*PARITY, "exec", "--out", str(out), *opts, "--",
            *(command or (sys.executable, TRAINER))]
    return subprocess.Popen(argv, env=_env(**knobs), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE.parent)


AFTER = "load,replace,buffer,swa"
JOBS = {  # name: trainer knobs (and "opts": parity exec options)
    "one_step": {"R4_STEPS": 1, "R4_CLAMP": 10},  # clamp to 10 changes nothing here
    "one_step_again": {"R4_STEPS": 1, "R4_CLAMP": 10},
    "one_step_clamped": {"R4_STEPS": 1, "R4_CLAMP": 0.05},
    "three": {"R4_CLAMP": 10, "R4_CLAMP_AFTER": 1},
    "three_clamped": {"R4_CLAMP": 0.05, "R4_CLAMP_AFTER": 1},
    "scale_big": {"R4_CASE": "scaler", "R4_SCALE": 65536},
    "scale_small": {"R4_CASE": "scaler", "R4_SCALE": 1024},
    "scale_inf": {"R4_CASE": "scaler", "R4_SCALE": 1024, "R4_INF_AT": 2},
    "twoopt": {"R4_CASE": "twoopt"},
    # edits after the last step (a new Parameter, a checkpoint loaded by assignment, a buffer
    # registered, an AveragedModel built): the final state reads the module trees again
    "after": {"R4_AFTER": AFTER},
    "after_again": {"R4_AFTER": AFTER},
    **{f"after_b_{e}": {"R4_AFTER": AFTER, "R4_AFTER_B": e} for e in AFTER.split(",")},
    # --every 2 over 5 steps: step 3 recorded by neither side, step 5 written at exit
    "every": {"R4_STEPS": 5, "opts": ("--every", "2")},
    "every_again": {"R4_STEPS": 5, "opts": ("--every", "2")},
    "every_osexit": {"R4_STEPS": 5, "R4_OSEXIT": 1, "opts": ("--every", "2")},
    # a non-persistent buffer of another value on each side: not hashed, said
    "npbuf": {"R4_STEPS": 1, "R4_NPBUF": 1},
    "npbuf_other": {"R4_STEPS": 1, "R4_NPBUF": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run dir, exit code, stderr)} of every job above."""
    root = tmp_path_factory.mktemp("round4")

    def start(name, knobs):
        opts = knobs.pop("opts", ())
        return root / name, _start(root / name, opts=opts, **knobs)

    return run_table(JOBS, start, timeout=TIMEOUT)



def _diff(a, b, *extra):
    return diff_cli(a, b, *extra, timeout=TIMEOUT)


def _steps(run: Path, rank: int = 0) -> list[dict]:
    return [json.loads(x) for x in (run / f"rank-{rank:05d}" / "steps.jsonl").read_text()
            .splitlines()]


# ------------------------------------------------------------------- the state the trainer ends with


def test_an_edit_after_the_only_step_fails_naming_the_final_state(runs):
    a, b = run_ok(runs, "one_step"), run_ok(runs, "one_step_clamped")
    rc, line, d = _diff(a, b)
    assert rc == EXIT_MISMATCH and line.startswith("PARITY FAILS"), line
    assert "hash mismatch in the final state (after step 1's optimizer step" in line, line
    fd = d["first_divergence"]
    assert fd["origin"] == "final" and d["final_state"]["equal"] is False
    assert sorted(x["fqn"] for x in d["divergent"]) == ["l1.bias", "l1.weight", "l2.bias",
                                                        "l2.weight"]
    # every step's own record matches: the final line is what tells them apart
    assert [s for s in _steps(a) if s["step"] != "final"] == \
        [s for s in _steps(b) if s["step"] != "final"]
    assert _steps(b)[-1]["changed"] is True and _steps(a)[-1]["changed"] is False


def test_identical_runs_hold_with_their_final_states_compared(runs):
    rc, line, d = _diff(run_ok(runs, "one_step"), run_ok(runs, "one_step_again"))
    assert rc == EXIT_OK and line.startswith("PARITY HOLDS"), line
    assert "final state" in line and d["final_state"] == {
        "compared": True, "after_step": 1, "equal": True, "ranks": [], "params": [],
        "params_differing": 0, "optimizer_state": 4}  # plain SGD: its group numbers only


def test_edits_after_the_last_step_are_read_from_the_module_trees(runs):
    """A parameter set on a module, a checkpoint loaded by assignment, a buffer registered and
    an AveragedModel built after the last step are not objects any step saw: the final state
    reads the trees again, so each one alone fails the pair, named (it held, exit 0, before)."""
    rc, line, d = _diff(run_ok(runs, "after"), run_ok(runs, "after_again"))
    assert rc == EXIT_OK and "final state" in line, line
    assert "hashed in the final state only" in line, line  # said, on both sides
    rows = params_codec.decode((run_ok(runs, "after") / "rank-00000" / "params.json").read_bytes())
    late = [r["fqn"] for r in rows if r.get("since") == 4]  # 3 steps: joined after step 3
    assert "calib" in late and any(f.startswith("AveragedModel.") or "module." in f
                                   for f in late), late
    want = {"load": "l1.weight", "replace": "l2.weight", "buffer": "calib", "swa": ".n_averaged"}
    for edit in AFTER.split(","):
        rc, line, d = _diff(run_ok(runs, "after"), run_ok(runs, f"after_b_{edit}"))
        assert rc == EXIT_MISMATCH and "hash mismatch in the final state" in line, (edit, line)
        assert d["final_state"]["equal"] is False and d["final_state"]["params"], edit
        if edit in ("load", "replace", "buffer"):
            assert any(want[edit] in f for f in d["final_state"]["params"]), \
                (edit, d["final_state"]["params"])


def test_steps_neither_side_recorded_are_said_and_an_unclosed_rank_is_incomplete(runs):
    """--every 2 over 5 steps on both sides: step 3 is recorded by neither, and step 5 is written
    at exit without gradients; the match says both. A run that ends in os._exit(0) never
    closes its records (step 5 and the final state are lost): incomplete, not a match."""
    rc, line, d = _diff(run_ok(runs, "every"), run_ok(runs, "every_again"))
    assert rc == EXIT_OK and line.startswith("PARITY HOLDS"), line
    assert "step(s) 3 (neither side recorded them: sampled every 2 step(s))" in line, line
    assert "gradients of step(s) 5 (neither side recorded them" in line, line
    assert d["not_recorded"] and d["steps_compared"] == [0, 1, 2, 4, 5]
    rc, line, d = _diff(run_ok(runs, "every"), run_ok(runs, "every_osexit"))
    assert rc == EXIT_INCOMPLETE and line.startswith("PARITY INCOMPLETE"), line
    assert any(m.startswith("B rank(s) 0 never closed their records") for m in d["incomplete"])
    # parity exec's own summary: the last record is step 4 of 5, and more may have run
    err = runs["every_osexit"][2]
    assert " x 4+ step(s) (3 recorded" in err and "steps after the last record are not known" \
        in err, err[-1500:]
    assert "never closed" in line


def test_an_edit_between_steps_is_attributed_to_the_interval(runs):
    a, b = run_ok(runs, "three"), run_ok(runs, "three_clamped")
    rc, line, d = _diff(a, b)
    assert rc == EXIT_MISMATCH, line
    fd = d["first_divergence"]
    assert d["first_divergent_step"] == 2 and fd["origin"] == "between", fd
    assert fd["phase"] == "after step 1's optimizer step, before or during step 2's forward", fd
    assert "(between steps: after step 1's optimizer step, before or during step 2's forward)" in line
    assert "step 1's parameters match" not in fd["explanation"]  # worded as the others
    assert "the parameters of step 1 match" in fd["explanation"]
    # B wrote an entry record for step 2 only (the clamp); A none (nothing changed)
    assert [s["step"] for s in _steps(b) if "entry_digest" in s] == [2]
    assert not any("entry_digest" in s for s in _steps(a))


# ------------------------------------------------------------------------------ a scaled loss


def test_different_loss_scales_with_identical_models_hold(runs):
    a, b = run_ok(runs, "scale_big"), run_ok(runs, "scale_small")
    rc, line, d = _diff(a, b)
    assert rc == EXIT_OK and line.startswith("PARITY HOLDS"), line
    assert [s.get("loss_scale") for s in _steps(a)[1:4]] == [65536.0] * 3
    assert [s.get("loss_scale") for s in _steps(b)[1:4]] == [1024.0] * 3
    assert any("loss scale differs (A 65536.0, B 1024.0 at step 1" in p["message"]
               for p in d["problems"])
    # the recorded loss is the unscaled one: the same on both sides, and the plain run's
    plain = [s["loss"] for s in _steps(run_ok(runs, "three"))[1:4]]
    assert [s["loss"] for s in _steps(a)[1:4]] == [s["loss"] for s in _steps(b)[1:4]] == plain


def test_a_step_the_scaler_skipped_is_recorded_and_named(runs):
    a, b = run_ok(runs, "scale_small"), run_ok(runs, "scale_inf")
    assert [s.get("skipped") for s in _steps(b)][:4] == [None, None, "inf", None]
    rc, line, d = _diff(a, b)
    assert rc == EXIT_MISMATCH and d["first_divergent_step"] == 2, line
    assert "B's GradScaler skipped step 2 on rank(s) 0" in d["first_divergence"]["explanation"]
    assert any(p["side"] == "b" and "the GradScaler skipped step(s) 2" in p["message"]
               for p in d["problems"])


# ------------------------------------------------------- the fingerprint of the compiled regions


def test_a_compile_mode_is_named_from_the_compiled_regions(tmp_path):
    """torch.compile(mode="max-autotune-no-cudagraphs") against no mode: the global inductor
    config says max_autotune False in both; the regions' own options tell them apart."""
    jobs = {name: _start(tmp_path / name, R4_CASE="compile", R4_STEPS=2, **extra)
            for name, extra in (("default", {}),
                                ("autotune", {"R4_MODE": "max-autotune-no-cudagraphs"}))}
    for name, p in jobs.items():
        out, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == EXIT_OK, err[-2000:]
        assert "unique graphs 1" in out, out  # noting the options recompiled nothing
    meta = json.loads((tmp_path / "autotune" / "rank-00000" / "meta.json").read_text())
    num = meta["numerics"]
    assert num["inductor"]["max_autotune"] is True
    assert num["inductor_regions"][0]["patch"] == {"coordinate_descent_tuning": True,
                                                   "max_autotune": True}
    assert num["inductor_regions"][0]["compile_ids"] == ["0/0"]
    plain = json.loads((tmp_path / "default" / "rank-00000" / "meta.json").read_text())
    assert plain["numerics"]["inductor"]["max_autotune"] is False
    assert plain["numerics"]["inductor_regions"][0]["patch"] == {}
    _, _, d = _diff(tmp_path / "default", tmp_path / "autotune")
    msgs = [p["message"] for p in d["problems"]]
    assert any(m.startswith("inductor config max_autotune differs (A False, B True)")
               for m in msgs), msgs
    assert any(m.startswith("inductor config coordinate_descent_tuning differs") for m in msgs)


# -------------------------------------------------------------------------- damage always said


def _copy(src: Path, dst: Path) -> Path:
    """A copy as if another process had recorded the same numbers (a plain copy is one
    recording with its original: incomplete, one_sided.same_run)."""
    shutil.copytree(src, dst)
    for m in dst.glob("rank-*/meta.json"):
        meta = json.loads(m.read_text())
        meta["pid"] = meta["pid"] + 100000
        m.write_text(json.dumps(meta))
    return dst / "rank-00000"


def _swap_rows(r: Path) -> None:
    p = r / "hashes.bin"
    off = next(s["param_offset"] for s in _steps(r.parent) if s["step"] == 2) + 20
    b = bytearray(p.read_bytes())
    b[off:off + 16], b[off + 16:off + 32] = b[off + 16:off + 32], b[off:off + 16]
    p.write_bytes(bytes(b))


def _cut_7(r: Path) -> None:
    p = r / "hashes.bin"
    p.write_bytes(p.read_bytes()[:-7])


def _flip_byte(r: Path) -> None:
    p = r / "hashes.bin"
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 1
    p.write_bytes(bytes(b))


def _edit_keys(r: Path) -> None:
    """Two names swapped in the fqn column, ``keys`` left as it was, the digest recomputed."""
    p = r / "params.json"
    data = p.read_bytes()
    keys = params_codec.read_header(data)[2]
    rows = params_codec.decode(data)
    rows[0]["fqn"], rows[1]["fqn"] = rows[1]["fqn"], rows[0]["fqn"]
    new = params_codec.encode(rows)
    body = new[params_codec._BODY:].replace(params_codec.read_header(new)[2].encode(),
                                            keys.encode())
    p.write_bytes(params_codec.PREFIX + xxhash.xxh3_128_hexdigest(body).encode() + b'",'
                  + body)


def _delete_meta(r: Path) -> None:
    (r / "meta.json").unlink()


@pytest.mark.parametrize("damage,said", [
    (_swap_rows, "step 2 param hashes do not have the roll-up"),
    (_cut_7, "cut short"),  # the last record: a figures record since issue 34
    # a hash record (roll-up), a figures record (digest) or a record's header (where the middle
    # byte lands depends on the table's rows: SGD's group numbers moved it into a header)
    (_flip_byte, ("do not have the", "not its")),
    (_edit_keys, "its keys do not match its fqn column"),
    (_delete_meta, "have no readable meta.json"),
])
def test_a_damaged_copy_of_a_run_is_never_a_clean_match(runs, tmp_path, damage, said):
    """A run against a copy of itself (a copy reads as intact: the recorded digests hold),
    damaged where the verdict does not need to look: incomplete, the damage named."""
    a = run_ok(runs, "three")
    rc, line, _ = _diff(a, _copy(a, tmp_path / "intact").parent)
    assert rc == EXIT_OK, line
    b = _copy(a, tmp_path / "damaged")
    damage(b)
    rc, line, d = _diff(a, b.parent)
    assert rc == EXIT_INCOMPLETE and line.startswith("PARITY INCOMPLETE"), line
    said = (said,) if isinstance(said, str) else said
    assert any(x in m for m in d["incomplete"] for x in said), d["incomplete"]
    assert d["verdict"] == "incomplete"


def test_meta_json_missing_on_one_side_is_named_with_what_it_leaves(runs, tmp_path):
    a = run_ok(runs, "three")
    b = _copy(a, tmp_path / "b")
    _delete_meta(b)
    _, line, _ = _diff(a, b.parent)
    assert "rank(s) 0 have no readable meta.json: their capture status and warnings, " \
           "hasher" in line, line


# --------------------------------------------------------------------- exit codes and wording


def test_two_optimizers_stepped_back_to_back_count_one_step(runs):
    _, rc, err = runs["twoopt"]
    assert rc == EXIT_OK, err
    assert ("captured 1 rank(s) x 3 step(s) (3 recorded; 2 optimizers: those stepped back to "
            "back count as one step)") in err, err
    assert "(6 recorded" not in err


@pytest.mark.parametrize("case,said", [
    ("reduce", "reduce (to one root) of a float sum is not modelled"),
    ("mixed", "the trainer asked for backend 'cpu:gloo,cuda:nccl'"),
])
def test_a_collective_the_emulation_refuses_exits_2(tmp_path, case, said):
    """The rank stops with exit 2 (nccl_emulation._refuse); torchrun makes that its own 1;
    `parity exec` exits 2, as documented, with the rank's reason in run.json."""
    out = tmp_path / case
    # torchrun next to this interpreter, else ``python -m torch.distributed.run`` (the venv may
    # not be activated: a bare "torchrun" was not found, or was another torch's)
    from tests.real_jobs import exe

    p = _start(out, *exe("torchrun", "torch.distributed.run"), "--standalone",
               "--nproc_per_node", "2", TRAINER, opts=("--emulate-nccl", "1x2"), R4_CASE=case)
    _, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == EXIT_USAGE, err[-3000:]
    assert f"parity: error: --emulate-nccl" in err and said in err, err[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["exit_code"] == EXIT_USAGE and said in run["error"], run


SWEEP_SPEC = '''
name = "resume-share"
steps = 2
nproc_per_node = 1
timeout = 600

[env]
OMP_NUM_THREADS = "1"
R4_STEPS = "2"

[axes.cand]
values = ["fail", "ok"]

[reference]
argv = ["{trainer}"]
[reference.flags.cand]

[candidate]
argv = ["{trainer}"]
[candidate.flags.cand]
fail = ["--fail-if", "{marker}"]
'''


def test_the_shared_reference_owner_keeps_its_link_after_resume(tmp_path):
    """The owner cell's candidate fails the first time; `--resume` reruns it alone, the
    reference job kept: the owner still says whom its reference job serves."""
    marker = tmp_path / "fail-now"
    marker.write_text("x")
    spec = tmp_path / "spec.toml"
    spec.write_text(SWEEP_SPEC.format(trainer=TRAINER, marker=marker))
    out = tmp_path / "sweep"

    def sweep(*extra):
        p = subprocess.run([*PARITY, "sweep", str(spec), "--out", str(out), *extra],
                           capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path,
                           env=_env())
        return p, {c["id"]: c for c in json.loads((out / "sweep.json").read_text())["cells"]}

    p, cells = sweep()
    assert cells["cand=fail"]["status"] == "failed", p.stdout[-2000:] + p.stderr[-2000:]
    assert cells["cand=fail"]["shares_reference_with"] == ["cand=ok"]
    assert cells["cand=ok"]["sides"]["reference"]["shared_from"] == "cand=fail"
    marker.unlink()
    p, cells = sweep("--resume")
    assert p.returncode == EXIT_OK, p.stdout[-2000:] + p.stderr[-2000:]
    owner = cells["cand=fail"]
    assert owner["status"] == "match" and owner["sides"]["reference"].get("reused")
    assert owner["shares_reference_with"] == ["cand=ok"], owner
    assert "reference job shared with cand=ok" in owner["reason"]


def test_non_persistent_buffers_are_named_as_not_compared(runs):
    """They are not in state_dict and not hashed (docs/capture.md): a match cannot cover them,
    so the verdict line names them; the runs differ only there and hold."""
    a, b = run_ok(runs, "npbuf"), run_ok(runs, "npbuf_other")
    meta = json.loads((a / "rank-00000" / "meta.json").read_text())
    assert meta["capture"]["non_persistent_buffers"] == ["mask"]
    rc, line, d = _diff(a, b)
    assert rc == EXIT_OK and line.startswith("PARITY HOLDS"), line
    said = [m for m in d["not_recorded"] if "non-persistent buffer" in m]
    assert said and said[0].startswith("1 non-persistent buffer(s) (mask: "), d["not_recorded"]
    assert "not compared: " in line and "1 non-persistent buffer(s) (mask" in line
    rc, line, d = _diff(run_ok(runs, "one_step"), run_ok(runs, "one_step_again"))
    assert not any("non-persistent" in m for m in d["not_recorded"]), d["not_recorded"]
