"""The optimizers' state in the final state (capture/opt_state.py, diff/opt_state.py), with
real processes: `parity exec` of tests/trainers/opt_state.py (which imports nothing from
parity), then the real CLI, each verdict checked against the runs' saved state dicts.

Before, optimizer state was never hashed: a one-step Adam pair with other betas (parameters,
gradients and loss bitwise equal, the moments not) HELD, saying only "not compared: optimizer
state". Now each optimizer's state tensors are rows of the final state, also when the
optimizer was freed before the process ended (a trainer's ``main()`` returned)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.diff.opt_state import not_compared_text
from parity.errors import EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import diff_cli, exe, knob_env, run_table

TRAINER = str(Path(__file__).parent / "trainers" / "opt_state.py")
TIMEOUT = 600

JOBS = {
    "adam": {},
    "adam_again": {},
    "adam_b1": {"OS_B1": "0.75"},  # the same first step, another exp_avg
    "sgd": {"OS_OPT": "sgd"},  # no state
    "sgd_momentum": {"OS_OPT": "sgd", "OS_MOM": "0.9"},  # momentum_buffer == gradient
}


def _start(run: Path, *cmd: str, **knobs):
    env = knob_env("OS_", OS_SAVE=str(run) + ".pt", **knobs)
    argv = [*exe("parity", "parity"), "exec", "--out", str(run), "--",
            *(cmd or (sys.executable, TRAINER))]
    return subprocess.Popen(argv, cwd=run.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("opt_state")

    def start(name, knobs):
        run = root / name
        p = _start(run, **knobs)
        return run, p

    out = {}
    for name, (run, rc, err) in run_table(JOBS, start).items():
        assert rc == EXIT_OK, f"{name}: {err[-2000:]}"
        out[name] = run
    return out


def _saved(run: Path) -> dict:
    return torch.load(str(run) + ".pt", weights_only=False)


def _equal_models(a: Path, b: Path) -> bool:
    sa, sb = _saved(a)["model"], _saved(b)["model"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_identical_runs_compare_the_optimizer_state_and_say_so(runs):
    rc, line, d = diff_cli(runs["adam"], runs["adam_again"])
    assert rc == EXIT_OK and line.startswith("PARITY HOLDS"), line
    assert "x 4 parameters (param, grad, loss, final state with optimizer state)" in line, line
    assert "optimizer state (" not in line, line  # compared: not under "not compared"
    # exp_avg, exp_avg_sq, step and the group's numbers (param_group, round 12b) of 4
    assert d["final_state"]["optimizer_state"] == 16
    table = json.loads((runs["adam"] / "rank-00000" / "params.json").read_text())["columns"]
    assert table["fqn"][4:7] == ["0.weight:exp_avg", "0.weight:exp_avg_sq", "0.weight:step"]
    meta = json.loads((runs["adam"] / "rank-00000" / "meta.json").read_text())
    assert meta["capture"]["optimizer_state_final"] is True


def test_adam_moments_that_differ_after_one_step_fail_in_the_final_state(runs):
    a, b = runs["adam"], runs["adam_b1"]
    assert _equal_models(a, b)  # the ground truth: the same parameters, other moments
    ma, mb = _saved(a)["opt"]["state"], _saved(b)["opt"]["state"]
    assert not torch.equal(ma[0]["exp_avg"], mb[0]["exp_avg"])
    assert torch.equal(ma[0]["exp_avg_sq"], mb[0]["exp_avg_sq"])
    rc, line, d = diff_cli(a, b)
    assert rc == EXIT_MISMATCH, line
    assert "hash mismatch in the final state (in the optimizer state after step 1" in line, line
    assert {x["kind"] for x in d["divergent"]} == {"optimizer_state"}
    assert sorted(x["fqn"] for x in d["divergent"]) == sorted(  # betas: the group's numbers
        f"{n}:{k}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")
        for k in ("exp_avg", "param_group"))
    assert "optimizer state the runs ended with differs" in d["first_divergence"]["explanation"]


def test_state_one_optimizer_keeps_and_the_other_does_not_is_a_difference(runs):
    a, b = runs["sgd"], runs["sgd_momentum"]
    assert _equal_models(a, b)  # momentum's first step is the plain one
    rc, line, d = diff_cli(a, b)
    assert rc == EXIT_MISMATCH, line  # not exit 2 "parameter sets differ"
    assert "in the optimizer state after step 1" in line, line
    # both hold each parameter's group numbers (param_group, which differ: momentum 0 against
    # 0.9); B alone the 4 momentum buffers
    assert "B alone holds 4 (0.weight:momentum_buffer" in d["first_divergence"]["explanation"]
    assert {x["fqn"].split(":")[1] for x in d["divergent"]} >= {"param_group"}, d["divergent"]
    assert d["params_only_in_b"] == []


def test_state_replaced_by_load_state_dict_is_freed_and_the_new_one_hashed(tmp_path):
    """Capture watches the optimizer's state objects to hash them if it is freed: a
    ``load_state_dict`` replaces them, and the replaced tensors must be freed as without
    parity (capture must not hold memory the job let go)."""
    p = subprocess.run([sys.executable, TRAINER], capture_output=True, text=True,
                       timeout=TIMEOUT, env=knob_env("OS_", OS_RELOAD="1", OS_STEPS="2"))
    assert "replaced state freed: True" in p.stdout, p.stdout + p.stderr  # without parity
    p = _start(tmp_path / "reload", OS_RELOAD="1", OS_STEPS="2")
    out, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == EXIT_OK, err[-2000:]
    assert "replaced state freed: True" in out, out + err  # with parity: the same
    table = json.loads((tmp_path / "reload" / "rank-00000" / "params.json").read_text())
    assert table["columns"]["fqn"][4:7] == ["0.weight:exp_avg", "0.weight:exp_avg_sq",
                                           "0.weight:step"]


def test_fsdp2_state_of_an_optimizer_freed_when_main_returned_is_compared(tmp_path):
    cmd = (*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node", "2",
           TRAINER)
    jobs = {name: _start(tmp_path / name, *cmd, OS_FSDP="1", **knobs)
            for name, knobs in (("a", {}), ("b", {}), ("b1", {"OS_B1": "0.75"}))}
    for name, p in jobs.items():
        _, err = p.communicate(timeout=TIMEOUT)
        assert p.returncode == EXIT_OK, f"{name}: {err[-2000:]}"
    rc, line, d = diff_cli(tmp_path / "a", tmp_path / "b")
    assert rc == EXIT_OK and "final state with optimizer state" in line, line
    assert d["final_state"]["optimizer_state"] == 16
    rc, line, d = diff_cli(tmp_path / "a", tmp_path / "b1")
    assert rc == EXIT_MISMATCH and "in the optimizer state after step 1" in line, line
    assert d["first_divergence"]["ranks"] == [0, 1]


@pytest.mark.parametrize("hashed,rows,said", [
    ((True, True), 12, None),
    ((False, False), 0, "not hashed"),
    ((True, False), 0, "hashed in the final state by A only"),
    ((True, True), 0, "hashed in the final state, which was not compared"),
])
def test_what_the_verdict_line_says_of_optimizer_state(hashed, rows, said):
    text = not_compared_text({"Adam": {"exp_avg", "step"}}, *hashed, rows)
    if said is None:
        assert text is None
    else:
        assert text.startswith("optimizer state (Adam: exp_avg, step; ") and said in text, text
    assert not_compared_text({}, False, False, 0) is None


def test_zero_against_plain_adam_compares_the_state_across_ranks(tmp_path):
    """``ZeroRedundancyOptimizer`` keeps each parameter's state on one rank, plain Adam on
    every rank: the rows a rank holds on one side only are compared with that name's rows on
    the other ranks (bitwise the same updates: HOLDS), not left out as "placed on other ranks"
    (exit 3)."""
    round6 = str(Path(__file__).parent / "trainers" / "round6.py")
    cmd = (*exe("torchrun", "torch.distributed.run"), "--standalone", "--nproc_per_node", "2",
           round6)
    jobs = {}
    for name, mode in (("zero", ""), ("plain", "plain")):
        env = knob_env("R6_", R6_CASE="zero", R6_MODE=mode)
        argv = [*exe("parity", "parity"), "exec", "--out", str(tmp_path / name), "--", *cmd]
        jobs[name] = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    errs = {}
    for name, p in jobs.items():
        _, errs[name] = p.communicate(timeout=TIMEOUT)
        assert p.returncode == EXIT_OK, f"{name}: {errs[name][-2000:]}"
    # the wrapped local optimizer steps inside ZeRO's own step(): one optimizer, not two
    assert "optimizers:" not in errs["zero"], errs["zero"][-2000:]
    zero0 = json.loads((tmp_path / "zero" / "rank-00000" / "params.json").read_text())
    assert len(zero0["columns"]["fqn"]) < 16  # rank 0 holds part of the state
    for a, b in (("zero", "plain"), ("plain", "zero")):
        rc, line, d = diff_cli(tmp_path / a, tmp_path / b)
        assert rc == EXIT_OK and "final state with optimizer state" in line, line
        assert d["final_state"]["optimizer_state"] == 16, d["final_state"]


def test_a_stateless_optimizer_has_its_group_numbers_as_rows():
    """SGD without momentum keeps no state; each of its parameters still gets a
    ``param_group`` row (round 14): without it, a learning rate a scheduler set after the last
    step (a resumed run's schedule one step off) HELD for SGD while the optimizers' state dicts
    differed, as round 12b found for Adam."""
    from parity.capture import opt_state

    net = torch.nn.Linear(2, 2)
    params = list(net.parameters())
    rows_of = {id(p): i for i, p in enumerate(params)}
    entries = [{"fqn": "weight"}, {"fqn": "bias"}]

    def rows(lr):
        opt = torch.optim.SGD(params, lr=lr)
        net(torch.ones(1, 2)).sum().backward()
        opt.step()
        assert not opt.state  # no state kept
        return opt_state.state_rows([opt], rows_of, entries, {"weight", "bias"})

    a, b = rows(0.1), rows(0.05)
    assert [n for n, _ in a] == ["weight:param_group", "bias:param_group"]
    assert not torch.equal(a[0][1], b[0][1])
    assert opt_state.ROWS_VERSION == 4
