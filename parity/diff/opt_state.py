"""The optimizers' state in the final state (capture/opt_state.py): which rows are state, which
state one side holds and the other does not, and what the verdict line says of it.

Why here and not in the alignment: state rows are compared by name like parameters, but they
differ from parameters in two ways. A sharded optimizer (``ZeroRedundancyOptimizer``) keeps
each parameter's state on one rank, a plain one on every rank: a state row one side's rank has
and the other side's same rank does not is compared with that name's rows on the other ranks
(diff/final_state.py: equal when every rank of both sides that holds it holds one value), not
left out as an entry "placed on other ranks". And Two runs whose optimizers keep other state (SGD with momentum
against SGD without: ``momentum_buffer`` rows on one side only) hold different state, which is
a difference in the final state (a FAIL), not two tables that cannot be compared (exit 2, as
for parameter sets that differ). And a run recorded before parity hashed optimizer state (no
``capture.optimizer_state_final``) has no state rows at all: against it the other side's rows
are not compared, and the verdict line says so instead of failing.
"""

from __future__ import annotations

from parity.artifacts import RankData
from parity.diff.one_sided import capture_of
from parity.records import KIND_OPTIMIZER_STATE

__all__ = ["state_names", "state_keys", "hashed_by", "rows_version", "split_one_sided",
           "not_compared_text"]


def state_names(rds: list[RankData]) -> set[str]:
    """Names of the optimizer-state rows in the tables of ``rds``, one table read per distinct
    table (ranks of one FSDP job list the same names: the diff parsed the first one already)."""
    distinct = {x.keys_digest: x for x in reversed(rds)}.values()
    return {p.get("fqn") for x in distinct for p in x.params
            if p.get("kind") == KIND_OPTIMIZER_STATE}


def state_keys(rd: RankData, keys: list[str]) -> list[str]:
    """The optimizer-state rows among ``keys`` of ``rd``'s table (a rank's unaligned names)."""
    if not keys:
        return []
    kinds = {p.get("fqn"): p.get("kind") for p in rd.params}
    return [k for k in keys if kinds.get(k) == KIND_OPTIMIZER_STATE]


def rows_version(rds: list[RankData]) -> set:
    """The ``capture.optimizer_state_rows`` versions of ``rds`` (None: before round 7, tensors
    only): capture/opt_state.ROWS_VERSION."""
    return {capture_of(x.meta).get("optimizer_state_rows") for x in rds}


def hashed_by(rds: list[RankData]) -> bool:
    """Every rank of ``rds`` hashed its optimizers' state in its final state."""
    return bool(rds) and all(capture_of(x.meta).get("optimizer_state_final") is True for x in rds)


def split_one_sided(only_a: list[str], only_b: list[str], ra: list[RankData],
                    rb: list[RankData]) -> tuple[list[str], list[str], set[str]]:
    """(``only_a`` and ``only_b`` without optimizer-state rows, the state names among them)."""
    if not only_a and not only_b:
        return only_a, only_b, set()
    state = state_names(ra) | state_names(rb)
    one = {k for k in (*only_a, *only_b) if k in state}
    return [k for k in only_a if k not in one], [k for k in only_b if k not in one], one


def not_compared_text(keys: dict[str, set], hashed_a: bool, hashed_b: bool,
                      compared_rows: int) -> str | None:
    """The verdict line's ``not compared:`` entry for optimizer state (``keys``: optimizer class
    -> the state's keys, capture.optimizer_state), None when state rows were compared in the
    final state (``compared_rows``) or no optimizer kept state. A difference in the state at
    step k shows in step k+1's parameters; the final state covers the last step's."""
    if not keys or compared_rows:
        return None
    what = "; ".join(f"{cls}: {', '.join(sorted(k))}" for cls, k in sorted(keys.items()))
    if hashed_a != hashed_b:
        why = (f"hashed in the final state by {'A' if hashed_a else 'B'} only (the other run "
               "did not: an older parity, or an optimizer it could not watch)")
    elif hashed_a:
        why = "hashed in the final state, which was not compared"
    else:
        why = "not hashed"
    return (f"optimizer state ({what}; {why}: a difference in it shows in later steps' "
            "parameters, not in the last step's)")
