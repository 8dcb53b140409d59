"""The diff engine: ``diff_runs(a_dir, b_dir) -> DiffResult`` (result.py).

A is the reference (usually eager FSDP2), B the candidate. This module reads the runs, checks
that they are comparable, and assembles the result; hashes.py compares per-parameter hashes
(alignment, roll-ups, drill-down), buckets.py the bucket layouts (and whether every rank of a
side agrees), bucket_summary.py what the bucketing passes did, env.py the numerics environment.
Nothing here prints.
"""

from __future__ import annotations

import operator
import struct
import time
from pathlib import Path

from parity.artifacts import RankData, ReadShare, Run, gc_paused, read_run
from parity.records import KIND_OPTIMIZER_STATE, SOURCE_C10D
from parity.diff.bucket_summary import summarize_pair
from parity.diff.buckets import (COLLECTIVES, Layout, OrderComparison, compare_buckets,
                                 drop_invalid_buckets, explain_eager)
from parity.diff import align as step_align
from parity.diff.emulation import check_same_emulation, emulation_gaps
from parity.diff import opt_state
from parity.diff.final_state import compare_final
from parity.diff.loss_factor import exact_factor, near_factor, near_factor_words
from parity.diff.opt_impl import compare_impl, impl_by_rank, impl_phrase, impl_words
from parity.diff.opt_numbers import compare_numbers, numbers_by_rank, numbers_words
from parity.diff.rng import compare_rng, rng_by_rank, rng_words
from parity.diff.scaled_loss import scaled_loss_notes, skipped_note
from parity.diff.env import numerics_env_differences
from parity.diff.magnitude import size_of_difference
from parity.diff.reduction import assess, observe
from parity.diff.one_sided import (capture_of, damaged, one_sided, refused_processes, same_run,
                                   unhashed)
from parity.diff.hashes import (DEFAULT_COUNT_BUDGET, KINDS, Aligner, HashComparison, ParamIndex,
                                compare_hashes, param_keys, step_fields)
from parity.diff.result import (CaptureWarning, ComparedRun, DiffResult, Divergence,
                                FirstDivergence, LossComparison, LossStep, Problem)
from parity.errors import EXIT_INCOMPLETE, ParityError
from parity.text import ranges

_SHOW = 5  # names shown in one-line messages


# ---------------------------------------------------------------------------------- the diff


def _names(names: list[str], n: int = _SHOW) -> str:
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def _world_size(run: Run) -> int:
    ws = run.world_size
    return ws if ws is not None else max(run.ranks) + 1


def _loss_bits(rec: dict | None):
    """What "bitwise equal" compares for a step's loss: the hash if captured, else the float."""
    if rec is None:
        return None
    h = rec.get("loss_hash")
    if isinstance(h, str) and h:
        return ("h", h)
    v = rec.get("loss")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return ("f", struct.pack("<d", float(v)))
    return None


def _loss_value(rec: dict | None) -> float | None:
    v = None if rec is None else rec.get("loss")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _loss_sum(vals: list[float | None], world: int | None) -> float | None:
    """The sum of every rank's loss of one step, when all ``world`` ranks have one."""
    if not vals or world is None or len(vals) != world or any(v is None for v in vals):
        return None
    return float(sum(vals))


def _compare_loss(ra: list[RankData], rb: list[RankData], ranks: list[int],
                  steps: list[int], world: int | None = None) -> LossComparison:
    n = len(steps)
    n_cmp, n_diff = [0] * n, [0] * n
    cols_a, cols_b = [], []  # per rank: its loss value at each step, per side
    for x, y in zip(ra, rb):
        recs_a = list(map(x.steps.get, steps))
        va = list(map(_loss_value, recs_a))
        cols_a.append(va)
        if step_fields(x.steps, y.steps, steps, "loss_hash", "loss") is not None:
            # the same hashes and values on both sides (the usual rank): equal where recorded
            for j, rec in enumerate(recs_a):
                n_cmp[j] += _loss_bits(rec) is not None
            cols_b.append(va)
            continue
        recs_b = list(map(y.steps.get, steps))
        cols_b.append(list(map(_loss_value, recs_b)))
        for j, (p, q) in enumerate(zip(recs_a, recs_b)):
            bx, by = _loss_bits(p), _loss_bits(q)
            if bx is None or by is None or bx[0] != by[0]:
                if bx is not None and by is not None:  # hash on one side, float on the other
                    fx, fy = _loss_value(p), _loss_value(q)
                    if fx is not None and fy is not None:
                        n_cmp[j] += 1
                        n_diff[j] += struct.pack("<d", fx) != struct.pack("<d", fy)
                continue
            n_cmp[j] += 1
            n_diff[j] += bx != by
    rows, captured, first = [], False, None
    for j, s in enumerate(steps):
        la = cols_a[0][j] if cols_a else None
        lb = cols_b[0][j] if cols_b else None
        if n_cmp[j] == 0 and la is None and lb is None:
            continue
        captured = captured or n_cmp[j] > 0
        equal = None if n_cmp[j] == 0 else n_diff[j] == 0
        if equal is False and first is None:
            first = s
        va = [col[j] for col in cols_a]
        vb = [col[j] for col in cols_b]
        rows.append(LossStep(s, la, lb, equal, int(n_diff[j]), _loss_sum(va, world),
                             _loss_sum(vb, world), va, vb))
    return LossComparison(captured, ranks[0] if ranks else None, first, rows)


# Without op-level evidence the hashes say WHAT differs at a step, not which pass made it
# differ: a forward that differs can leave the loss bitwise equal (the rounding absorbed it) and
# still change every gradient; the forward, the backward and the gradient reduction all feed
# the gradients. So the label names what was compared and found ("loss equal, gradients
# differ"), and the explanation says what that does and does not tell; `parity bisect` compares
# op by op. Only what the records prove is named: a loss that differs from equal parameters
# (the forward of that step computed another loss), parameters that differ from equal
# gradients and equal parameters before (the optimizer step).
BISECT_HINT = "`parity bisect` compares op by op and names where it enters"


def _origin(step: int, prev: int | None, grad_div: bool, param_div: bool,
            loss_div: bool | None, grads_compared: bool,
            buffers_only: list[str] | None = None, start: int = 0) -> tuple[str, str, str]:
    """(origin code, label, explanation) of the first divergent step (docs/diff.md).
    ``start``: the step both sides start from (0; an aligned pair's anchor, align.py)."""
    before = (f"the parameters of step {prev} match" if prev is not None
              else "no earlier step was captured")
    if prev is not None and prev != step - 1:
        before += f" (steps {prev + 1}-{step - 1} not captured)" if step - 1 > prev + 1 else \
            f" (step {step - 1} not captured)"
    if buffers_only and not grad_div and not loss_div:
        return "buffer", "only buffers differ", (
            f"only buffers differ at step {step} ({_names(buffers_only, 3)}) while every "
            f"parameter matches and {before}: buffer updates in the forward pass (BatchNorm "
            "running statistics and the like) or a buffer set differently, not the optimizer")
    if step == start and start and param_div and not grad_div:
        return "init", "parameters differ where the aligned steps start", (
            f"the parameters of step {step} (the state the resumed side started from, its step "
            "0) differ from the other side's: what was loaded from the checkpoint, or the "
            "checkpoint itself")
    if step == 0 and param_div and not grad_div:
        return "init", "parameters differ before the first optimizer step", (
            "the parameters differ before the first optimizer step: initialization, loading or "
            "sharding")
    if loss_div and not grad_div and grads_compared:
        return "loss", "loss differs, gradients equal", (
            f"the loss of step {step} differs while its gradients match and {before}: the loss "
            "computation or its reduction")
    if loss_div:
        grads = (", gradients differ" if grad_div else
                 ", gradients not recorded" if not grads_compared else "")
        return "forward", "loss differs" + grads, (
            f"the loss of step {step} differs while {before}: the forward computation of step "
            f"{step} (or its input) differs; {BISECT_HINT}")
    if grad_div:
        if loss_div is False:
            return "backward", "loss equal, gradients differ", (
                f"the gradients of step {step} differ while its loss is bitwise equal and "
                f"{before}. The hashes do not tell which pass: a forward that differs can leave "
                "the loss equal (the rounding absorbs it), and the backward and the gradient "
                f"reduction feed the gradients too; {BISECT_HINT}")
        return "backward", "gradients differ, loss not recorded", (
            f"the gradients of step {step} differ while {before} (the loss was not recorded): "
            f"the forward, the backward or the gradient reduction; {BISECT_HINT}")
    if param_div:
        if grads_compared:
            return "optimizer", "gradients equal, parameters differ", (
                f"the parameters of step {step} differ while its gradients match and {before}: "
                "the optimizer step")
        return "param", "parameters differ, gradients not recorded", (
            f"the parameters of step {step} differ while {before} (the gradients of step "
            f"{step} were not recorded, so the passes cannot be told from the optimizer)")
    return "loss", "loss differs, every hash equal", (
        f"the loss of step {step} differs while every hash of that step matches")


def diff_runs(a_dir: str | Path, b_dir: str | Path, *, allow_param_mismatch: bool = False,
              count_budget: int = DEFAULT_COUNT_BUDGET, tolerate_exit: bool = False,
              at=None, align_steps: str | None = None) -> DiffResult:
    """Compare run B against reference run A (see docs/diff.md).

    Raises ParityError (exit 2) when the runs cannot be compared: not parity run directories,
    different world sizes, or (unless ``allow_param_mismatch``) different parameter sets; exit 3
    when a side failed before recording a step. A side whose job exited non-zero is incomplete,
    unless ``tolerate_exit`` (the sweep's ``tolerate_teardown_exit``): then it is a problem only.
    ``at``: a topology (``parity.nccl.Topology`` or ``"8x8"``) to predict the reduction
    order at (``result.reduction_order``, parity/diff/reduction.py). ``align_steps``: none |
    auto | B+K | A+K (parity/diff/align.py: B's step i against A's step K+i, a run resumed from
    a checkpoint against the run it came from); exit 2 for an offset not proven or out of range.
    """
    t0 = time.perf_counter()
    with gc_paused():
        shared = ReadShare()  # ranks of both sides with identical bucket records share them
        run_a = read_run(a_dir, shared)
        run_b = read_run(b_dir, shared)
        al = step_align.resolve(align_steps, run_a, run_b)
        run_a, run_b = step_align.apply(al, run_a, run_b)  # every reader below reads these
        t_read = time.perf_counter()
        result = _diff(run_a, run_b, allow_param_mismatch, count_budget, tolerate_exit, at,
                       al.start)
    result.align = al.to_dict()
    note = al.before_note()
    if note:
        result.not_recorded.insert(0, note)
    t_end = time.perf_counter()
    result.stats.update({"read_seconds": round(t_read - t0, 3),
                         "compare_seconds": round(t_end - t_read, 3)})
    return result


def _hashers(run: Run) -> set[str]:
    """The digests a run's ranks used (meta.json ``capture.hasher``; the device digest with its
    ``device_digest_version``, 1 when a run from before versions were recorded has none): xxh3
    and the device checksum never agree, nor do two versions of the device checksum, so runs
    that differ here are not comparable."""
    out = set()
    for rd in run.ranks.values():
        if not rd.steps:  # a rank that recorded nothing never resolved "auto"
            continue
        cap = capture_of(rd.meta)
        h = cap.get("hasher")
        if h == "device":
            h = f"device v{cap.get('device_digest_version') or 1}"
        if isinstance(h, str):
            out.add(h)
    return out


def _failed(run: Run) -> str | None:
    """Why the job of ``run`` failed (run.json written by ``parity exec``), or None."""
    meta = run.run_meta
    if meta is None or meta.get("status") in ("ok", "running", None):
        return None
    return str(meta.get("error") or f"status {meta.get('status')!r}, exit code "
                                   f"{meta.get('exit_code')!r}")


def _capture_warnings(run: Run, side: str) -> list[CaptureWarning]:
    """Capture warnings of one side, one entry per distinct message with the ranks saying it."""
    by_msg: dict[str, list[int]] = {}
    for r, rd in sorted(run.ranks.items()):
        ws = capture_of(rd.meta).get("warnings")
        for w in ws if isinstance(ws, list) else ():
            by_msg.setdefault(str(w), []).append(r)
    return [CaptureWarning(side, rs, m) for m, rs in by_msg.items()]


def _diff(run_a: Run, run_b: Run, allow_param_mismatch: bool, count_budget: int,
          tolerate_exit: bool = False, at=None, start: int = 0) -> DiffResult:
    """The diff's phases, in order: what each side says of itself, whether the runs can be
    compared, which ranks, parameters and steps both sides have, the hashes, the buckets, the
    first divergence, the verdict. Each phase is a function below; ``problems`` (said, not
    failing) and ``incomplete`` (not compared: the verdict cannot be ``match``) collect in the
    order the report prints them. ``start``: the step both sides start from (their step 0; an
    aligned pair's anchor, align.py), where no gradient or loss was recorded."""
    drop_invalid_buckets(run_a, run_b)  # before anything reads them; said as damage
    problems = _run_problems(run_a, run_b)
    incomplete = _failed_jobs(run_a, run_b, tolerate_exit, problems)
    incomplete += damaged(run_a, run_b)
    ws = _comparable_world_size(run_a, run_b)
    problems += [Problem(None, m) for m in numerics_env_differences(
        run_a.ranks[min(run_a.ranks)].meta if run_a.ranks else None,
        run_b.ranks[min(run_b.ranks)].meta if run_b.ranks else None)]
    warnings = _capture_warnings(run_a, "a") + _capture_warnings(run_b, "b")
    _capture_disabled(run_a, run_b, incomplete)
    usable, ranks = _usable_ranks(run_a, run_b, ws, problems, incomplete)

    ra = [run_a.ranks[r] for r in ranks]
    rb = [run_b.ranks[r] for r in ranks]

    # -- parameters
    n_before = {id(x): len(x.problems) for x in ra + rb}  # what lazy reads add is said too
    index, aligns, only_a, only_b, one_state = _align_params(ra, rb, ranks,
                                                             allow_param_mismatch, incomplete)
    state_hashed = (opt_state.hashed_by(ra), opt_state.hashed_by(rb))

    # -- steps
    steps = sorted(set().union(*(x.steps for x in ra), *(y.steps for y in rb))) if ranks else []
    side_steps = _side_steps(run_a, run_b, usable)

    hc = compare_hashes(ranks, ra, rb, aligns, steps, count_budget)
    _lazy_problems(ra, rb, n_before, problems)
    both = hc.compared_rows  # numpy only where something differs (hashes.py)
    steps_compared = hc.steps_compared if ranks else []
    gaps_alike: list[str] = []  # steps ranks that ended early on both sides did not record
    _step_gaps(steps, ranks, ra, rb, both, incomplete, gaps_alike)
    _coverage_gaps(hc, ranks, steps_compared, aligns, incomplete)
    loss = _compare_loss(ra, rb, ranks, steps, ws)
    loss.factor = exact_factor(loss.steps)  # a loss scaled by 2^k (diff/loss_factor.py)
    if loss.factor is not None:
        loss.first_divergent_step = None  # compared as scaled: said on the verdict line
    # what one side recorded and the other did not is not compared: parity is not proven
    incomplete += one_sided(ra, rb, ranks, steps, _loss_bits)
    incomplete += refused_processes(run_a, run_b)
    incomplete += emulation_gaps(run_a, run_b)  # sums gloo made under --emulate-nccl
    incomplete += unhashed(run_a, run_b)
    same = same_run(run_a, run_b)
    if same:
        incomplete.insert(0, same)
    reshaped = _check_tables(ranks, ra, rb, aligns, only_a, only_b, problems,
                             _ranks_to_check(hc, ranks))

    # -- buckets
    layouts, order = compare_buckets(run_a, run_b, usable, ranks)
    # consequence classes of every bucket difference; the reduction-order prediction with ``at``
    reduction = assess(run_a, run_b, ranks, layouts, order, ws, at)

    # -- first divergence
    first, fd, divergent = _first_divergence(run_a, ra, rb, ranks, steps_compared, index, hc,
                                             loss, layouts, order, start)
    if reduction is not None:  # an emulated pair: predicted against observed
        observe(reduction, divergent, first)
    if fd is not None and reshaped:  # hashes of other slices: the verdict line says so
        fd.label += (f"; {reshaped[0]} shard(s) differ in shape or dtype ({reshaped[1]}): "
                     "sharded otherwise, their hashes differ even where the values are equal")

    # -- the state the runs ended with (after the trainer's last edit)
    states = opt_state.state_names(ra) | one_state  # (tables the alignment parsed)
    n_params, state_gids = _n_compared(aligns, index, states)
    final = compare_final(ranks, ra, rb, aligns, index, all(state_hashed), state_gids,
                          opt_state.rows_version(ra) == opt_state.rows_version(rb))
    incomplete += final.incomplete
    if first is None and final.ranks:
        buffers = {p["fqn"] for x in ra[:1] + rb[:1] for p in x.params
                   if p.get("kind") == "buffer"}
        fd, divergent = _final_divergence(final, index, buffers, states, layouts)
        first = fd.step
    problems += scaled_loss_notes(ra, rb, ranks, steps)
    if fd is not None and fd.origin in ("forward", "loss") and loss.factor is None:
        r = near_factor(loss.steps)  # a loss divided by M before backward on one side only
        if r is not None:  # the scale, named before the forward it otherwise blames
            forward = f"the forward computation of step {fd.step} (or its input) differs"
            fd.explanation = fd.explanation.replace(
                forward, f"likely a loss scaled otherwise (below), not another forward "
                f"computation of step {fd.step}", 1)
            fd.explanation += near_factor_words(r)
    if fd is not None:
        fd.explanation += skipped_note(ra, rb, fd.step)
        if fd.origin in ("optimizer", "param"):
            fd.explanation += _optimizer_rows_note(final, index)
    if fd is not None and fd.origin != "final":  # another random stream (diff/rng.py)
        fd.rng = compare_rng(rng_by_rank(ra), rng_by_rank(rb), ranks)
        if start and fd.rng is not None and fd.rng["recorded"] != "both":
            fd.rng = None  # aligned, one side has no step after the anchor: nothing to say
        label, words = rng_words(fd.rng, fd.step)
        if label:
            fd.label = f"{fd.label}; {label}" if fd.label else f"{fd.origin}; {label}"
        fd.explanation += words
    # the optimizers' group numbers per step (diff/opt_numbers.py): said at a divergence, and a
    # divergence of their own where every hash matched (a job configured otherwise: FAIL)
    numbers = compare_numbers(numbers_by_rank(ra), numbers_by_rank(rb), ranks)
    if start and numbers is not None and numbers["recorded"] != "both":
        numbers = None  # aligned, one side has no step after the anchor: nothing to say
    if fd is None and numbers is not None and numbers["first_differs"] is not None:
        fd = _numbers_divergence(numbers)
        first, divergent = fd.step, []
    elif fd is not None:
        fd.opt_numbers = numbers
        label, words = numbers_words(numbers, fd.step)
        if label:
            fd.label = f"{fd.label}; {label}" if fd.label else f"{fd.origin}; {label}"
        fd.explanation += words
    # the optimizers' classes and flags (diff/opt_impl.py): the likely cause at a divergence of
    # the update; with every hash equal, said on the verdict line (tolerated), never a FAIL
    impl = compare_impl(impl_by_rank(ra), impl_by_rank(rb), ranks)
    if impl is not None:
        impl["words"] = impl_phrase(impl)
        if fd is not None:
            label, words = impl_words(impl, fd.origin, fd.step)
            if label:
                fd.label = f"{fd.label}; {label}" if fd.label else f"{fd.origin}; {label}"
            fd.explanation += words

    # the size of each difference, from the figures next to the hashes (summaries, no verdict)
    magnitude = size_of_difference(ra, rb, ranks, aligns, index, divergent,
                                   divergent[0].step if divergent else None, steps_compared)
    if fd is not None and magnitude.get("absent") and fd.step == divergent[0].step:
        fd.explanation += _absent_note(magnitude["absent"])
    _lazy_problems(ra, rb, n_before, problems)  # tables parsed for the checks above
    verdict = _verdict(first, incomplete)
    sides = _sides(run_a, run_b, ws, usable, side_steps, layouts)
    per_step = [c for c in hc.counts if first is not None and c.step >= first]
    return DiffResult(
        a=sides["a"], b=sides["b"], verdict=verdict, incomplete=incomplete, world_size=ws,
        ranks_compared=ranks, steps_compared=steps_compared,
        params_compared=n_params,
        bucketing=summarize_pair(run_a, run_b),
        kinds_compared=["param", "grad"] if hc.grads_compared else ["param"],
        params_only_in_a=only_a, params_only_in_b=only_b, first_divergent_step=first,
        first_divergence=fd, divergent=divergent, per_step=per_step, loss=loss, order=order,
        problems=problems, stats={"cells_drilled": hc.cells_drilled}, warnings=warnings,
        reduction_order=reduction, magnitude=magnitude, final_state=final.to_dict(index),
        opt_impl=impl,
        not_recorded=gaps_alike + _not_recorded(ra, rb, steps, state_hashed,
                                                final.state_rows if final.compared else 0,
                                                start)
        + _other_rows(final, index),
    )


def _run_problems(run_a: Run, run_b: Run) -> list[Problem]:
    """What the reader found in each run, and ranks that did not end cleanly: said in the
    report, but not a reason to stop comparing what was recorded."""
    problems: list[Problem] = []
    problems += [Problem("a", m) for m in run_a.problems]
    problems += [Problem("b", m) for m in run_b.problems]
    for side, run in (("a", run_a), ("b", run_b)):
        bad = [r for r, rd in sorted(run.ranks.items()) if rd.meta.get("status") not in ("ok", None)]
        if bad:
            st = run.ranks[bad[0]].meta
            problems.append(Problem(side, f"rank(s) {ranges(bad)} did not end cleanly "
                                          f"(rank {bad[0]}: status {st.get('status')!r}"
                                          + (f", {st.get('error')}" if st.get("error") else "")
                                          + ")"))
    return problems


def _failed_jobs(run_a: Run, run_b: Run, tolerate_exit: bool,
                 problems: list[Problem]) -> list[str]:
    """The incomplete list, started with the sides whose job failed (run.json). A side that
    failed before recording a step stops the diff here: its failure is the only thing to say."""
    incomplete: list[str] = []
    for side, run in (("a", run_a), ("b", run_b)):
        failed = _failed(run)
        if failed and not any(rd.steps for rd in run.ranks.values()):
            # Nothing to compare: say why this side has nothing, not what else differs.
            raise ParityError(f"{side.upper()} failed before recording a step: {failed}",
                              exit_code=EXIT_INCOMPLETE)
        if failed and tolerate_exit:
            problems.append(Problem(side, f"the job failed ({failed}); tolerated"))
        elif failed:
            incomplete.append(f"{side.upper()} failed: {failed}")
        else:
            incomplete += _unclosed(side, run)
    return incomplete


def _unclosed(side: str, run: Run) -> list[str]:
    """Ranks whose records were never closed (meta.json still ``running``) in a job that did not
    fail: the process ended without parity's exit handler (``os._exit``, a signal its launcher
    did not report) or is still running. What it recorded is compared; what it ran after its
    last record (a step ``--every`` skipped, the final state) is not known, so not proven."""
    open_ = [r for r, rd in sorted(run.ranks.items()) if rd.meta.get("status") == "running"]
    if not open_:
        return []
    last = max((max(run.ranks[r].steps, default=0) for r in open_), default=0)
    return [f"{side.upper()} rank(s) {ranges(open_)} never closed their records (the process "
            f"ended without parity's exit handler, or is still running): what ran after their "
            f"last recorded step ({last}) is not known"]


def _comparable_world_size(run_a: Run, run_b: Run) -> int:
    """The world size both runs share; raises (exit 2) for runs whose hashes cannot be set side
    by side at all: other world sizes, other hashers, other NCCL emulation."""
    ws_a, ws_b = _world_size(run_a), _world_size(run_b)
    if ws_a != ws_b:
        raise ParityError(f"world sizes differ: A ({run_a.path}) has {ws_a} ranks, "
                          f"B ({run_b.path}) has {ws_b}")
    ws = ws_a
    h_a, h_b = _hashers(run_a), _hashers(run_b)
    if h_a and h_b and h_a != h_b:
        raise ParityError(f"the runs used different hashers (A {'/'.join(sorted(h_a))}, "
                          f"B {'/'.join(sorted(h_b))}): their hashes cannot be compared; "
                          "capture both with the same --hasher (and the same parity version "
                          "for device digests)")
    check_same_emulation(run_a, run_b)  # emulated numbers differ from plain ones on purpose
    return ws


def _capture_disabled(run_a: Run, run_b: Run, incomplete: list[str]) -> None:
    """Ranks where capture turned itself off: their later steps were never recorded; ranks
    whose meta.json ``capture`` is not an object (damaged): what capture did there is not
    known."""
    for side, run in (("a", run_a), ("b", run_b)):
        odd = [r for r, rd in sorted(run.ranks.items())
               if isinstance(rd.meta, dict) and rd.meta.get("capture") is not None
               and not isinstance(rd.meta.get("capture"), dict)]
        if odd:
            got = type(run.ranks[odd[0]].meta.get("capture")).__name__
            incomplete.append(f"{side.upper()}: rank(s) {ranges(odd)} have a meta.json whose "
                              f"capture is a {got}, not an object (damaged): their capture "
                              "settings, status and warnings are not known")
        off = [r for r, rd in sorted(run.ranks.items()) if capture_of(rd.meta).get("disabled")]
        if off:
            why = capture_of(run.ranks[off[0]].meta).get("disabled")
            incomplete.append(f"{side.upper()}: capture was disabled on rank(s) {ranges(off)} "
                              f"({why}); later steps not recorded there")


def _usable_ranks(run_a: Run, run_b: Run, ws: int, problems: list[Problem],
                  incomplete: list[str]) -> tuple[dict[str, list[int]], list[int]]:
    """(each side's ranks with a parameter table, the ranks both sides have): only those are
    compared; a rank one side lacks is said as incomplete, and so is a rank folder outside the
    world size (its records are not compared)."""
    usable: dict[str, list[int]] = {}
    for side, run in (("a", run_a), ("b", run_b)):
        ok = [r for r, rd in sorted(run.ranks.items()) if rd.n_params and 0 <= r < ws]
        no_table = [r for r in sorted(run.ranks) if r not in ok and 0 <= r < ws]
        if no_table:
            problems.append(Problem(side, f"rank(s) {ranges(no_table)} have no "
                                          "parameter table (params.json); not compared"))
        extra = sorted(r for r in run.ranks if not 0 <= r < ws)
        if extra:  # what was recorded there is not compared: never a clean verdict
            incomplete.append(f"{side.upper()}: rank directories {ranges(extra)} are outside "
                              f"the world size {ws}: what they hold is not compared")
        usable[side] = ok
        # what capture could not see (a graph path it does not hook, a manifest it could not
        # read) is said in meta.json; the verdict line's reader must see it too
        said: list[str] = []
        for r in ok[:1] or sorted(run.ranks)[:1]:
            cap = capture_of(run.ranks[r].meta)
            said += [w for w in cap.get("warnings") or () if isinstance(w, str) and w not in said]
        problems += [Problem(side, f"capture: {w}") for w in said[:_SHOW]]
        if len(said) > _SHOW:
            problems.append(Problem(side, f"capture: ... and {len(said) - _SHOW} more warnings "
                                          "(meta.json capture.warnings)"))
    ranks = sorted(set(usable["a"]) & set(usable["b"]))
    for side in ("a", "b"):
        missing = [r for r in range(ws) if r not in usable[side]]
        if missing:
            other = "b" if side == "a" else "a"
            has = [r for r in missing if r in usable[other]]
            incomplete.append(f"{side.upper()} is missing rank(s) {ranges(missing)}"
                              + (f" ({other.upper()} has {ranges(has)})" if has else ""))
    return usable, ranks


def _align_params(ra: list[RankData], rb: list[RankData], ranks: list[int],
                  allow_param_mismatch: bool, incomplete: list[str]):
    """(index, per-rank alignments, names only in A, names only in B): parameters are matched
    by normalized FQN, rank by rank. Different parameter sets are not comparable (exit 2)
    unless allowed; then only the common ones are compared and the diff is incomplete."""
    index = ParamIndex()
    aligner = Aligner(index)
    seen_keys: dict = {}
    keys_a, keys_b = _table_keys(ra, seen_keys), _table_keys(rb, seen_keys)
    names_a: dict[str, None] = {}
    names_b: dict[str, None] = {}
    for ka in {id(k): k for k in keys_a}.values():  # by identity: ranks share keys tuples
        names_a.update(dict.fromkeys(ka))
    for kb in {id(k): k for k in keys_b}.values():
        names_b.update(dict.fromkeys(kb))
    only_a = [k for k in names_a if k not in names_b]
    only_b = [k for k in names_b if k not in names_a]
    # optimizer state one side holds and the other does not: a final-state difference (or
    # not compared against a run that hashed none), not parameter sets that differ
    only_a, only_b, one_state = opt_state.split_one_sided(only_a, only_b, ra, rb)
    if (only_a or only_b) and not allow_param_mismatch:
        parts = []
        if only_a:
            parts.append(f"{len(only_a)} only in A: {_names(only_a)}")
        if only_b:
            parts.append(f"{len(only_b)} only in B: {_names(only_b)}")
        raise ParityError("parameter sets differ (normalized FQNs): " + "; ".join(parts))
    if only_a or only_b:  # allowed: compare the common ones, but parity is not proven
        incomplete.append(f"parameter sets differ ({len(only_a)} only in A, {len(only_b)} only "
                          "in B); compared the common ones")
    index.ids_of(list(names_a))  # global ids in A's order
    aligns = [aligner.align(ka, kb) for ka, kb in zip(keys_a, keys_b)]
    del keys_a, keys_b
    _unaligned(ranks, aligns, set(only_a) | set(only_b) | one_state, incomplete, ra, rb)
    return index, aligns, only_a, only_b, one_state


def _side_steps(run_a: Run, run_b: Run, usable: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each side's steps recorded on every one of its usable ranks (the result's sides)."""
    side_steps = {}
    for side, run in (("a", run_a), ("b", run_b)):
        present = [run.ranks[r] for r in usable[side]]
        side_steps[side] = (sorted(set.intersection(*(set(x.steps) for x in present)))
                            if present else [])
    return side_steps


def _coverage_gaps(hc: HashComparison, ranks: list[int], steps_compared: list[int], aligns,
                   incomplete: list[str]) -> None:
    """Hashes that could not be read, and a diff that compared no step, rank or parameter:
    nothing compared is never a ``match``."""
    if hc.unreadable:
        side, r, s, k = hc.unreadable[0]
        incomplete.append(f"{len(hc.unreadable)} hash line(s) could not be read (first: "
                          f"{side.upper()} rank {r} step {s} {k})")
    if ranks and not steps_compared:
        incomplete.append("no step was recorded by both sides")
    if not ranks:
        incomplete.append("no rank has a parameter table on both sides")
    elif not any(al.gids for al in aligns):
        incomplete.append("no parameter was compared: no rank's table shares an entry with the "
                          "other side's same rank")


def _ranks_to_check(hc: HashComparison, ranks: list[int]) -> set[int]:
    """Positions in ``ranks`` whose tables are checked (shapes, per-rank entries): the first
    and last rank and those that diverge; checking every rank would parse every table."""
    check = {0, len(ranks) - 1} if ranks else set()
    if hc.detail is not None:
        pos = {r: i for i, r in enumerate(ranks)}
        for kind in KINDS:
            for _, r in hc.detail.pairs[kind][:16]:
                check.add(pos[r])
    return check


def _first_divergence(run_a: Run, ra: list[RankData], rb: list[RankData], ranks: list[int],
                      steps_compared: list[int], index: ParamIndex, hc: HashComparison,
                      loss: LossComparison, layouts: dict[str, Layout], order: OrderComparison,
                      start: int = 0
                      ) -> tuple[int | None, FirstDivergence | None, list[Divergence]]:
    """(first divergent step, what happened there, the divergent parameters): the earlier of
    the first step whose hashes differ and the first whose loss differs; where it began
    (gradients, update, loss) and the buckets behind a divergent gradient."""
    first_hash = hc.first_step
    first_loss = loss.first_divergent_step
    cands = [s for s in (first_hash, first_loss) if s is not None]
    first = min(cands) if cands else None
    divergent: list[Divergence] = []
    fd = None
    if first is not None:
        det = hc.detail  # the first step whose hashes differ (later than ``first`` if only the
        at_first = det is not None and det.step == first  # loss differed before)
        loss_div = None
        for ls in loss.steps:
            if ls.step == first:
                loss_div = None if ls.equal is None else not ls.equal
        grad_div = bool(at_first and det.any("grad"))
        param_div = bool(at_first and det.any("param"))
        entry_div = bool(at_first and det.any("entry"))
        prev_steps = [s for s in steps_compared if s < first]
        prev = prev_steps[-1] if prev_steps else None
        grads_here = hc.grads_compared and all(
            isinstance((x.steps.get(first) or {}).get("grad_digest"), str) for x in ra + rb)
        buffers = {p["fqn"] for x in ra[:1] + rb[:1] for p in x.params
                   if p.get("kind") == "buffer"}
        div_params = [index.names[g] for g, _ in det.grouped("param")] if at_first else []
        only_buffers = (div_params if div_params and buffers
                        and all(n.split("#", 1)[0] in buffers for n in div_params) else None)
        phase = None
        if entry_div:
            origin, why, phase = _between(first, prev, loss_div, grad_div)
            label = "parameters changed between step() calls"
        else:
            origin, label, why = _origin(first, prev, grad_div, param_div, loss_div,
                                         grads_here, only_buffers, start)
            if origin == "init" and not start:
                shifted = _resumed_at(ra, rb)
                label, why = (f"{label}; {shifted}", f"{why}; {shifted}") if shifted else (
                    label, why)
        loc_a, loc_b = layouts["a"].locate(), layouts["b"].locate()
        rank_set: set[int] = set()
        n_kind = {}
        listed: set[tuple[str, str]] = set()
        # an edit between step() calls first (the parameters the step found), then the step
        for kind in ("entry", "grad", "param"):
            grouped = det.grouped(kind) if det else []
            n_kind[kind] = len(grouped)
            for gid, rks in grouped:
                name = index.names[gid]
                row_kind = "buffer" if kind == "param" and buffers and \
                    name.split("#", 1)[0] in buffers else ("param" if kind == "entry" else kind)
                if (name, row_kind) in listed:
                    continue
                listed.add((name, row_kind))
                rank_set.update(rks)
                divergent.append(Divergence(det.step, name, row_kind, rks,
                                            _links(name, loc_a, loc_b)))
        if entry_div:
            n_kind["param"] = n_kind["entry"]
        if not at_first:
            n_kind = {"param": 0, "grad": 0}
            rank_set = set()
        why = _explain_eager(why, divergent, run_a, ranks, layouts, order)
        fd = FirstDivergence(first, origin, grad_div, prev, n_kind["param"],
                             n_kind["grad"] if hc.grads_compared else None, sorted(rank_set),
                             loss_div, why, label, phase)
    return first, fd, divergent


def _resumed_at(ra: list[RankData], rb: list[RankData]) -> str | None:
    """A side whose step 0 has, on every rank, the parameter hashes of the other side's step j
    > 0 (the same j everywhere): a run resumed from a checkpoint of the other's step j. Steps
    are compared by their number (step 1 of the resumed run against step 1 of the other), so
    the pair fails at step 0 whatever follows; said, with where the runs line up and the option
    that aligns them (rounds 12b, 14b: align.py)."""
    got = step_align.resumed_offset(ra, rb)
    if got is None:
        return None
    side, j = got
    ys, xs = side.upper(), "A" if side == "b" else "B"
    return (f"{ys}'s step 0 has {xs}'s step {j} parameters on every rank ({ys} resumed "
            f"from {xs}'s step {j}?): steps are compared by number, {ys}'s step k "
            f"against {xs}'s step k, not {xs}'s step {j}+k; --align-steps {ys}+{j} (or auto) "
            "compares them so")


def _optimizer_rows_note(final, index: ParamIndex) -> str:
    """The first divergence's explanation, continued when it began at the optimizer step and
    the final state's ``param_group`` rows (lr, betas, eps, weight decay: capture/opt_state.py)
    differ: unlike the moments (``exp_avg``), which follow any divergence, these numbers do not
    depend on the parameters' values, so a difference in them is a hyperparameter or a schedule
    that differs (round 14b: a resumed run whose scheduler was not restored). A hint, named as
    such: the rows are of the state the runs ended with, not of the divergent step."""
    if not final.compared or not final.differs:
        return ""
    rows = [index.names[g] for g, _ in final.differs]
    groups = [n.rsplit(":", 1)[0] for n in rows if n.endswith(":param_group")]
    if not groups:
        return ""
    return (f"; the optimizer's param_group numbers (lr, betas, eps, weight decay) of "
            f"{_names(groups, 3)} differ in the final state too: they do not follow from the "
            "parameters' values, so a hyperparameter or a learning-rate schedule differs (a "
            "resumed run: a scheduler not restored?)")


def _absent_note(absent: list[dict]) -> str:
    """The first divergence's explanation, continued: the tensors one side did not have (a
    gradient left None, e.g. ``zero_grad(set_to_none=True)`` and a parameter the forward did not
    use, against a zeroed gradient on the other side: magnitude._absent)."""
    parts = []
    for side in ("a", "b"):
        names = [x["fqn"] for x in absent if x.get("side") == side]
        if names:
            parts.append(f"{side.upper()} has no gradient or tensor there (None) for "
                         f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}")
    return ("; " + "; ".join(parts) + " where the other side has one (a gradient set to None "
            "against one zeroed, for instance)") if parts else ""


def _between(step: int, prev: int | None, loss_div: bool | None,
             grad_div: bool) -> tuple[str, str, str]:
    """(origin, explanation, phase) of parameters that changed between ``step()`` calls: the
    ones step ``step``'s optimizer step found differ while step ``step - 1``'s records match.
    Where in the interval it happened is read from what the step itself recorded: a loss that
    differs too says the forward already used the edited parameters; a matching loss cannot
    place it closer than before the optimizer step (an EMA copy is not in the forward). A
    differing loss cannot tell an edit before the forward from one inside it (a clamp in
    ``forward()``), so the phase says "before or during". A global optimizer step post-hook
    (``register_optimizer_step_post_hook``) runs after parity's own, registered first, and its
    edit lands here too: the explanation names it."""
    after = f"after step {step - 1}'s optimizer step" if step > 1 else "after step 0"
    if loss_div:
        where = f"before or during step {step}'s forward (its loss differs too)"
    elif loss_div is False and not grad_div:
        where = (f"before step {step}'s optimizer step (its loss and gradients match: after its "
                 "backward, or in parameters its forward does not use, such as an EMA copy)")
    elif loss_div is False:
        where = (f"before step {step}'s optimizer step (its loss matches, its gradients "
                 "differ)")
    else:
        where = f"before step {step}'s optimizer step"
    phase = f"{after}, {where.split(' (')[0]}"
    before = (f"the parameters of step {prev} match" if prev is not None
              else "no earlier step was captured")
    return "between", (f"the parameters changed {after} and {where}, while {before}: the "
                       "trainer edited them in place outside the optimizer's update (a clamp, "
                       "an EMA or weight update by hand, weights loaded, an edit inside "
                       "forward(), a global optimizer step post-hook: those run after the "
                       "step is recorded), not through gradients and an optimizer step"), phase


def _final_divergence(fc, index: ParamIndex, buffers: set[str], states: set[str],
                      layouts: dict[str, Layout]) -> tuple[FirstDivergence, list[Divergence]]:
    """What differs in the final state when every step matched: the trainer changed the model
    after its last ``step()``, or the optimizers' state differs (``states``: those rows'
    names; opt_state.py), which no step's parameters show yet."""
    k = fc.after_step
    loc_a, loc_b = layouts["a"].locate(), layouts["b"].locate()
    divergent = []
    for gid, rks in fc.differs:
        name = index.names[gid]
        base = name.split("#", 1)[0]
        kind = ("buffer" if base in buffers else
                KIND_OPTIMIZER_STATE if name in states or base in states else "param")
        divergent.append(Divergence(k, name, kind, rks, _links(name, loc_a, loc_b)))
    n_buf = sum(1 for d in divergent if d.kind == "buffer")
    n_state = sum(1 for d in divergent if d.kind == KIND_OPTIMIZER_STATE)
    n_par = len(divergent) - n_buf - n_state
    parts = [f"{n} {w}" for n, w in ((n_par, "parameter(s)"), (n_buf, "buffer(s)"),
                                     (n_state, "optimizer state tensor(s)")) if n]
    what = " and ".join(parts)
    if n_state and not n_par and not n_buf:
        held = "; ".join(_state_sides(fc, index))
        why = (f"every step matches and so do the final parameters, but the optimizer state the "
               f"runs ended with differs ({what}, on rank(s) {ranges(fc.ranks)}"
               + (f"; {held}" if held else "") + "): the optimizers' update rules or settings "
               "differ (betas, momentum, another optimizer) in a way the parameters do not show "
               f"by step {k}; a later step's would")
        phase = f"in the optimizer state after step {k}'s optimizer step"
    else:
        why = (f"every step matches, but the state the runs ended with differs ({what}, on "
               f"rank(s) {ranges(fc.ranks)}): the model was changed after step {k}'s optimizer "
               "step, when the run ended (an edit after the last step(), a last update by hand, "
               "an evaluation forward that updated buffers)")
        phase = f"after step {k}'s optimizer step, when the run ended"
    return FirstDivergence(k, "final", False, k, len(divergent), None, sorted(fc.ranks), None,
                           why, "final state differs", phase), divergent


def _state_sides(fc, index: ParamIndex) -> list[str]:
    """Which side holds state rows the other lacks (``SGD momentum`` on one side only)."""
    out = []
    for side, gids in (("A", fc.state_only_a), ("B", fc.state_only_b)):
        if gids:
            names = [index.names[g] for g in gids]
            out.append(f"{side} alone holds {len(names)} ({_names(names, 3)})")
    return out


def _numbers_divergence(numbers: dict) -> FirstDivergence:
    """Every hash matched, but the optimizers' group numbers differ at a step: the runs were
    configured otherwise then (a schedule that differs only in the middle of the run, the lr of
    a group whose parameters had no gradient). A difference of the job, so a divergence: the
    final state's ``param_group`` rows fail it already when it lasts to the end."""
    s = numbers["first_differs"]
    label, words = numbers_words(numbers, s)
    why = ("every hash matches, but" + words[1:]  # (words: "; the optimizers' ...")
           + "; no parameter they act on had a gradient then, or the difference ended before "
           "it reached one: the runs are other jobs, whose hashes agree by chance of this data")
    fd = FirstDivergence(s, "optimizer", False, numbers["equal_before"], 0, None,
                         sorted(numbers["ranks"]), None, why, label,
                         f"in the optimizer's group numbers at step {s}'s optimizer step")
    fd.opt_numbers = numbers
    return fd


def _verdict(first: int | None, incomplete: list[str]) -> str:
    """A divergence is a mismatch whatever else is missing; ``match`` only with nothing left
    uncompared."""
    if first is not None:
        verdict = "hash_mismatch"
    elif incomplete:
        verdict = "incomplete"
    else:
        verdict = "match"
    return verdict


def _sides(run_a: Run, run_b: Run, ws: int, usable: dict[str, list[int]],
           side_steps: dict[str, list[int]], layouts: dict[str, Layout]
           ) -> dict[str, ComparedRun]:
    """Each run as the diff saw it (the result's ``a`` and ``b``)."""
    sides = {}
    for side, run, lay in (("a", run_a, layouts["a"]), ("b", run_b, layouts["b"])):
        sides[side] = ComparedRun(str(run.path), ws, usable[side],
                           [r for r in range(ws) if r not in usable[side]], side_steps[side],
                           (run.run_meta or {}).get("status"),
                           lay.source or _all_reduce_source(run, usable[side]))
    return sides


def _all_reduce_source(run: Run, ranks: list[int]) -> str | None:
    """"c10d" when a side's only bucket records are c10d all-reduces (DDP, HSDP's replicate
    dimension, hand-written all-reduces): the layouts compare no reduce-scatter or all-gather,
    but the side did record manifests (reduction.py reads them), so the header must not say
    "manifests: none"."""
    rd = run.ranks.get(ranks[0]) if ranks else None
    recs = rd.buckets if rd is not None else []
    return SOURCE_C10D if any(r.get("source") == SOURCE_C10D for r in recs) else None


def _explain_eager(why: str, divergent: list[Divergence], run_a: Run, ranks: list[int],
                   layouts: dict[str, Layout], order: OrderComparison) -> str:
    """Append to the first divergence's explanation the eager collectives behind a divergent
    gradient (e.g. lm_head under a chunked loss: 8 reduce-scatters against FSDP2's one)."""
    ea, eb = order.eager.get("a") or [], order.eager.get("b") or []
    repeats = layouts["a"].repeats or layouts["b"].repeats
    if not (ea or eb or repeats) or not ranks or ranks[0] not in run_a.ranks:
        return why
    shapes = {p["fqn"]: "x".join(str(d) for d in (p.get("global_shape") or p.get("shape") or []))
              for p in run_a.ranks[ranks[0]].params}
    lines = []
    for d in divergent:
        if d.kind != "grad" or len(lines) >= 3:
            continue
        line = explain_eager(d.fqn, shapes.get(d.fqn), layouts["a"], layouts["b"], ea, eb)
        if line and line not in lines:
            lines.append(line)
    return ". ".join([why.rstrip("."), *lines]) if lines else why


def _lazy_problems(ra: list[RankData], rb: list[RankData], n_before: dict,
                   problems: list[Problem]) -> None:
    """What the ranks' lazy reads (table rows, hash records) found since ``n_before``."""
    for side, lst in (("a", ra), ("b", rb)):
        for x in lst:
            problems += [Problem(side, m) for m in x.problems[n_before[id(x)]:]]
            n_before[id(x)] = len(x.problems)


def _table_keys(lst: list[RankData], seen: dict) -> list[tuple[str, ...]]:
    """Each rank's alignment keys, parsed once per distinct key sequence (``seen``, by the
    table's ``keys`` digest): 256 FSDP ranks of both sides list the same names and share one
    tuple, one table parse."""
    out = []
    for x in lst:
        k = x.keys_digest
        keys = seen.get(k)
        if keys is None:
            keys = seen[k] = tuple(param_keys(x.params))
        out.append(keys)
    return out


def _n_compared(aligns, index: ParamIndex, states: set[str]) -> tuple[int, set[int]]:
    """(parameters and buffers compared, the optimizer-state rows aligned: ``states`` names)."""
    distinct = list({id(al): al for al in aligns}.values())
    if not distinct:
        return 0, set()
    # a set of the Python ids: no numpy on the path of two identical runs
    gids = set().union(*(al.gids for al in distinct))
    state_gids = {g for g in gids if index.names[g] in states} if states else set()
    return len(gids) - len(state_gids), state_gids


def _links(name: str, loc_a: dict, loc_b: dict) -> dict:
    base = name.split("#", 1)[0]
    la = loc_a.get(name) or loc_a.get(base) or {}
    lb = loc_b.get(name) or loc_b.get(base) or {}
    return {c: {"a": la.get(c), "b": lb.get(c)} for c in COLLECTIVES}


_SHAPE = operator.itemgetter("shape", "dtype")


def _check_tables(ranks, ra, rb, aligns, only_a, only_b, problems,
                  shape_rows: set[int]) -> tuple[int, str] | None:
    """Per-rank table differences that do not stop the diff: entries one rank has on one side
    only (while both sides know the name, every rank), shards of different shape or dtype (the
    ranks in ``shape_rows``: comparing 1,500 shapes on 256 ranks costs more than the diff).
    Returns (how many shards differ in shape or dtype, the first one) or None: an FSDP2 run
    against a DDP run hashes a shard on one side and the whole tensor on the other, which
    differ for equal values; the verdict line names that cause (round 7), not only a warning
    at the report's end."""
    missing_msgs, shape_msgs, n_shape, first = [], [], 0, ""
    seen: set[tuple] = set()
    glob_only = set(only_a) | set(only_b)
    for row, (r, x, y, al) in enumerate(zip(ranks, ra, rb, aligns)):
        loc_a = [k for k in al.only_a if k not in glob_only]
        loc_b = [k for k in al.only_b if k not in glob_only]
        if loc_a or loc_b:
            parts = []
            if loc_a:
                parts.append(f"{len(loc_a)} entries only in A's table ({_names(loc_a, 2)})")
            if loc_b:
                parts.append(f"{len(loc_b)} only in B's ({_names(loc_b, 2)})")
            missing_msgs.append(f"rank {r}: {'; '.join(parts)}; not compared")
        if row not in shape_rows or x.table_digest == y.table_digest:
            continue  # equal digests: the same rows, shapes included (neither table is parsed)
        pa, pb = x.params, y.params
        key = (id(pa), id(pb))
        if key in seen:
            continue
        seen.add(key)
        try:
            if al.identity:
                sa, sb = list(map(_SHAPE, pa)), list(map(_SHAPE, pb))
            else:
                sa = list(map(_SHAPE, map(pa.__getitem__, al.ia.tolist())))
                sb = list(map(_SHAPE, map(pb.__getitem__, al.ib.tolist())))
        except KeyError:
            sa = [(pa[i].get("shape"), pa[i].get("dtype")) for i in al.ia.tolist()]
            sb = [(pb[j].get("shape"), pb[j].get("dtype")) for j in al.ib.tolist()]
        if sa != sb:
            rows = al.ia.tolist()
            for k, (u, v) in enumerate(zip(sa, sb)):
                if u != v:
                    n_shape += 1
                    if len(shape_msgs) < _SHOW:
                        shape_msgs.append(f"rank {r} {pa[rows[k]]['fqn']}: shape/dtype {u[0]} "
                                          f"{u[1]} in A, {v[0]} {v[1]} in B")
                        first = first or (f"first: rank {r} {pa[rows[k]]['fqn']} {u[0]} in A, "
                                          f"{v[0]} in B")
    for m in missing_msgs[:_SHOW]:
        problems.append(Problem(None, m))
    if len(missing_msgs) > _SHOW:
        problems.append(Problem(None, f"... and {len(missing_msgs) - _SHOW} more ranks whose "
                                      "tables differ"))
    for m in shape_msgs:
        problems.append(Problem(None, m))
    if n_shape > len(shape_msgs):
        problems.append(Problem(None, f"... {n_shape} shards differ in shape or dtype in all"))
    return (n_shape, first) if n_shape else None


def _ended_ok(rd: RankData) -> bool:
    """Whether the rank's ``meta.json`` says it ended cleanly (not killed, not raising)."""
    return isinstance(rd.meta, dict) and rd.meta.get("status") == "ok"


def _step_gaps(steps, ranks, ra, rb, both, incomplete, not_recorded) -> None:
    if not ranks or not steps:
        return
    if all(len(x.steps) == len(steps) for x in ra) and all(len(y.steps) == len(steps) for y in rb):
        return  # every rank of both sides has every step (``steps`` is their union)
    import numpy as np

    from parity.diff.hashes import presence_table

    pa, pb = presence_table(ra, steps), presence_table(rb, steps)
    for name, mine, other in (("A", pa, pb), ("B", pb, pa)):
        lack = other & ~mine
        if lack.any():
            cols = np.flatnonzero(lack.any(axis=0))
            rws = np.flatnonzero(lack.any(axis=1))
            incomplete.append(
                f"{name} lacks {int(lack.sum())} (rank, step) record(s) that "
                f"{'B' if name == 'A' else 'A'} has: step(s) {ranges([steps[j] for j in cols])} on "
                f"{len(rws)} rank(s) (first: rank {ranks[rws[0]]})")
    neither = ~pa & ~pb
    # a rank that ended cleanly on both sides and recorded the same steps there trained fewer
    # steps by design (uneven inputs, DDP ``Join``): nothing either side recorded is left out,
    # so it is said under "not compared", not incomplete (round 6: identical runs were exit 3)
    ended = np.array([_ended_ok(x) and _ended_ok(y) and x.steps.keys() == y.steps.keys()
                      for x, y in zip(ra, rb)])
    by_design = neither & ended[:, None]
    if by_design.any():
        cols = np.flatnonzero(by_design.any(axis=0))
        rws = np.flatnonzero(by_design.any(axis=1))
        not_recorded.append(f"step(s) {ranges([steps[j] for j in cols])} on rank(s) "
                            f"{ranges([ranks[i] for i in rws])} (their training ended earlier "
                            "on both sides, cleanly: neither side recorded them)")
    neither &= ~by_design
    if neither.any():
        cols = np.flatnonzero(neither.any(axis=0))
        rws = np.flatnonzero(neither.any(axis=1))
        # a step some rank recorded and this (rank, step) on neither side: the ranks of a run
        # stopped at different steps (a job interrupted mid-step), not data lost on both sides
        incomplete.append(f"step(s) {ranges([steps[j] for j in cols])} recorded by some ranks "
                          f"only: {int(neither.sum())} (rank, step) record(s) neither side has, "
                          f"on {len(rws)} rank(s) (first: rank {ranks[rws[0]]}; its run stopped "
                          "earlier there)")


def _not_recorded(ra: list[RankData], rb: list[RankData], steps: list[int],
                  state_hashed: tuple[bool, bool] = (False, False),
                  state_rows: int = 0, start: int = 0) -> list[str]:
    """What neither side recorded: steps both skipped (``--every``), gradients of steps both
    recorded without them (the last step, written at exit when sampling skipped it), no
    gradients or no loss at all (``--no-grads``; a trainer that never calls ``backward`` on a
    loss), optimizer state where no state row was compared in the final state (``state_rows``;
    diff/opt_state.py) and non-persistent buffers (never hashed: capture.non_persistent_buffers).
    Not missing data (exit 3 is for what one side has and the other lacks): both sides chose it
    alike (optimizer state hashed by one side only: a run of an older parity). But a ``match``
    does not cover it, so the verdict line says it."""
    out: list[str] = []
    if not ra or not steps:
        return out
    runs = ra + rb
    lo, hi = min(steps), max(steps)
    if hi - lo + 1 > len(steps):
        have = set(steps)
        gaps = [s for s in range(lo, hi + 1) if s not in have]
        every = sorted({e for x in runs for e in [capture_of(x.meta).get("every")]
                        if isinstance(e, int) and e > 1})
        why = (f"sampled every {' / '.join(map(str, every))} step(s)" if every else
               "no record of them on either side")
        out.append(f"step(s) {ranges(gaps)} (neither side recorded them: {why})")

    def grads(rd: RankData, s: int) -> bool:
        return isinstance((rd.steps.get(s) or {}).get("grad_offset"), int)

    later = [s for s in steps if s > start]  # steps that trained (``start`` holds no gradients)
    any_a = any(grads(x, s) for s in later for x in ra)
    any_b = any(grads(y, s) for s in later for y in rb)
    if later and not any_a and not any_b:
        out.append("gradients (neither side recorded them)")
    elif any_a and any_b:  # (one side only: said as incomplete, one_sided.py)
        bare = [s for s in later if not any(grads(x, s) for x in runs)]
        if bare:
            out.append(f"gradients of step(s) {ranges(bare)} (neither side recorded them: a "
                       "step that sampling skipped is written at exit without its gradients)")
    if later and not any(_loss_bits(x.steps.get(s)) is not None for s in later for x in runs):
        out.append("the loss (neither side recorded it: no backward() of a loss tensor)")
    state_keys: dict[str, set] = {}
    np_names: dict[str, None] = {}
    for x in runs:
        cap = capture_of(x.meta)
        got = cap.get("optimizer_state")
        for cls, keys in (got.items() if isinstance(got, dict) else ()):
            if isinstance(keys, list):
                state_keys.setdefault(str(cls), set()).update(str(k) for k in keys)
        for n in cap.get("non_persistent_buffers") or ():
            if isinstance(n, str):
                np_names.setdefault(n)
    said = opt_state.not_compared_text(state_keys, *state_hashed, state_rows)
    if said:
        out.append(said)
    if np_names:
        names = list(np_names)
        shown = ", ".join(names[:3]) + (f", +{len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"{len(names)} non-persistent buffer(s) ({shown}: not in state_dict, not "
                   "hashed; a change in one shows in the loss and gradients, which are)")
    return out


def _other_rows(final, index: ParamIndex) -> list[str]:
    """The verdict line's entry for optimizer-state rows one side's parity makes and the
    other's does not (capture.optimizer_state_rows differs: Python numbers, lists and a second
    optimizer's ``#2`` rows are rows since round 7): not compared, rather than a FAIL of two
    runs of one job recorded by two versions of parity."""
    if not final.state_versions:
        return []
    names = [index.names[g] for g in final.state_versions]
    return [f"{len(names)} optimizer-state row(s) ({_names(names, 2)}) that one side's parity "
            "hashes and the other's does not (another version: numbers, lists, a second "
            "optimizer's state, param groups)"]


def _unaligned(ranks, aligns, glob_only: set, incomplete: list[str], ra, rb) -> None:
    """Entries a rank's table has on one side only, while the other side has that name on some
    other rank (a pipeline-stage split or an expert placement that moved): not compared, so
    parity is not proven."""
    n, bad = 0, []
    for r, al, x_a, x_b in zip(ranks, aligns, ra, rb):
        # (optimizer-state rows are compared across ranks: diff/final_state.py)
        la = [x for x in al.only_a if x not in glob_only]
        lb = [x for x in al.only_b if x not in glob_only]
        k = (len(la) - len(opt_state.state_keys(x_a, la))
             + len(lb) - len(opt_state.state_keys(x_b, lb)))
        if k:
            n += k
            bad.append(r)
    if bad:
        incomplete.append(f"{n} table entries on rank(s) {ranges(bad)} have no counterpart on "
                          "the other side's same rank (parameters placed on other ranks); not "
                          "compared")
