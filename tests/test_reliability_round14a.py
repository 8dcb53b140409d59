"""Round 14a: collectives whose groups or layouts differ only on ranks other than the reference
rank (the lowest compared), at 6 ranks. ``parity exec`` of tests/trainers/round14a.py (imports
nothing from parity; saves every step's loss, token count, gradients and parameters and the
final parameters per rank), values compared with ``torch.equal`` between runs (the ground truth).

Found and fixed (docs/reliability.md, "Round 14a"): the order comparison read the reference
rank's groups only, and the all-reduce layouts and the ``--at`` prediction the reference rank
only. A token count all-reduced over ``{0,1},{2,3},{4,5}`` against ``{0,1},{2,4},{3,5}``, DDP
buckets packed in another order on ranks 3-5 only, and FSDP2's bucket reordered on one replica
only all HELD "bucket layouts identical" (or FAILED ``any`` but predicted "same sums" at
``--at 2x3``, exit 0 under ``--fail-on reduction``). parity/diff/other_ranks.py now compares
every rank's groups and all-reduce lines relative to the reference rank, and the diff compares
and predicts the ranks it names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK
from tests.real_jobs import REPO, diff_cli, run_ok, trainer_runs, values_equal

TRAINER = str(REPO / "tests" / "trainers" / "round14a.py")
TIMEOUT = 900
N = 6
PAIRS = "0,1/2,3/4,5"
_DDP = {"R14A_MODE": "ddp", "R14A_SAME": 1, "R14A_TOK": PAIRS, "nproc": N}
JOBS = {  # name: trainer knobs
    "ddp": _DDP,  # DDP over rows {0,1,2},{3,4,5}; a token count over pairs
    "ddp_again": _DDP,  # the same job again (an identical pair)
    "tok": {**_DDP, "R14A_TOK": "0,1/2,4/3,5"},  # the token count over other pairs, rank 0's alike
    "ddp_re": {**_DDP, "R14A_REORDER_FROM": 3},  # ranks 3-5 register the layers reversed
    # FSDP2 over each row alone (two replicas), B's second replica's bucket reordered
    "fsdp": {"R14A_MODE": "fsdp", "nproc": N},
    "fsdp_re": {"R14A_MODE": "fsdp", "R14A_REORDER_FROM": 3, "nproc": N},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return trainer_runs(tmp_path_factory.mktemp("round14a"), JOBS, TRAINER, "R14A_",
                        nproc=N, timeout=TIMEOUT)


def values(run: Path) -> list:
    import torch

    out = []
    for r in range(N):
        t = torch.load(f"{run}.truth.{r}", weights_only=False)
        out.append({k: t[k] for k in ("steps", "final")})
    return out


def _same_values(runs, a: str, b: str) -> tuple[Path, Path]:
    pa, pb = run_ok(runs, a), run_ok(runs, b)
    assert values_equal(values(pa), values(pb)), (a, b)
    return pa, pb


def test_a_token_count_over_other_pairs_beyond_rank_0(runs):
    """Rank 0 sums its token count with rank 1 on both sides; ranks 2-5 with other partners
    ([2, 3] against [2, 4]). Every value equal (each rank holds rank 0's data). Was HOLDS
    "bucket layouts identical" under ``--fail-on any`` and "same sums predicted" at 2x3 (exit
    0 under ``--fail-on reduction``); now the group differs on rank 2, and ``--at`` is
    unknown."""
    a, b = _same_values(runs, "ddp", "tok")
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "bucket group differs" in line, line
    assert "group ranks [2, 3] in A, [2, 4] in B on rank 2" in line, line
    rc, line, _ = diff_cli(a, b, timeout=TIMEOUT)
    assert rc == EXIT_OK and "tolerated: bucket group differs" in line, line
    rc, line, _ = diff_cli(a, b, "--fail-on", "reduction", "--at", "2x3", timeout=TIMEOUT)
    assert rc == EXIT_INCOMPLETE and "unknown" in line and "same sums" not in line, line


def test_ddp_buckets_packed_otherwise_on_ranks_3_to_5(runs):
    """DDP over {3,4,5} packs its buckets in another order in B (the layers registered
    reversed there); rank 0's group is as in A. Values equal (identical data: any order sums
    alike on gloo). Was HOLDS "bucket layouts identical" and "same sums predicted"; now the
    all-reduce order differs on rank 3 and ``--at`` predicts rank 3 too (unknown)."""
    a, b = _same_values(runs, "ddp", "ddp_re")
    rc, line, out = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH, line
    assert "bucket order differs (all_reduce bucket 0 position 0 on rank 3)" in line, line
    assert out["order"]["rank"] == 3 and out["order"]["first_bucket"]["rank"] == 3
    rc, line, _ = diff_cli(a, b, "--fail-on", "reduction", "--at", "2x3", timeout=TIMEOUT)
    assert rc == EXIT_INCOMPLETE and "same sums" not in line, line


def test_an_fsdp_bucket_reordered_on_one_replica_is_predicted_there(runs):
    """FSDP2 over {0,1,2} and {3,4,5} apart, B's second replica's bucket in another order:
    values equal (gloo and, by hand, ``--emulate-nccl 2x3``). ``--fail-on any`` already FAILED
    (buckets._compare_odd_ranks); ``--at 2x3`` predicted the reference rank only: "same sums
    predicted", exit 0 under ``--fail-on reduction``. Now rank 3 is predicted too: its
    reduce-scatter over 3 of 6 ranks is not placed at the target, unknown."""
    a, b = _same_values(runs, "fsdp", "fsdp_re")
    rc, line, _ = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_MISMATCH and "on rank 3" in line, line
    rc, line, out = diff_cli(a, b, "--fail-on", "reduction", "--at", "2x3", timeout=TIMEOUT)
    assert rc == EXIT_INCOMPLETE and "same sums" not in line, line
    reasons = [u["reason"] for u in out["reduction_order"]["unpredicted"]]
    assert any("over 3 of 6 ranks" in r for r in reasons), reasons


def test_identical_jobs_still_hold(runs):
    """The same job twice: HOLDS identical under every policy, nothing said of other ranks."""
    a, b = _same_values(runs, "ddp", "ddp_again")
    rc, line, out = diff_cli(a, b, "--fail-on", "reduction", "--at", "2x3", timeout=TIMEOUT)
    assert rc == EXIT_OK and "same sums predicted" in line, line
    rc, line, out = diff_cli(a, b, "--fail-on", "any", timeout=TIMEOUT)
    assert rc == EXIT_OK and "bucket layouts identical" in line, line
    assert not any("reference rank" in n for n in out["order"]["notes"]), out["order"]["notes"]
