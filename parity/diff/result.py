"""The result of ``parity diff``: the data model (:class:`DiffResult` and its parts), its JSON
(``to_dict``, ``write_json``; schema ``parity/schemas/diff.schema.json``, docs/diff.md) and
the ``--fail-on`` verdict it asks parity.policy for. The engine (engine.py) builds it."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from parity import policy
from parity.consequences import reduction_state
from parity.artifacts import write_json_atomic
from parity.diff.buckets import BucketPair, OrderComparison
from parity.diff.hashes import StepCount
from parity.errors import ParityError

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).parent.parent / "schemas" / "diff.schema.json"
VERDICTS = ("match", "hash_mismatch", "incomplete")
FAIL_ON = tuple(policy.POLICIES)


# ------------------------------------------------------------------------------------ the model


@dataclass
class ComparedRun:
    """One run as the diff saw it: ``DiffResult.a`` (the reference) or ``.b`` (the candidate)."""

    path: str
    world_size: int | None
    ranks: list[int]  # ranks with a usable parameter table
    missing_ranks: list[int]  # ranks of range(world_size) without one
    steps: list[int]  # steps complete on every usable rank
    status: str | None  # run.json status, if any
    bucket_source: str | None  # records.SOURCE_FSDP2 | SOURCE_GRAPH | None (no manifests)


@dataclass
class Problem:
    side: str | None  # "a" | "b" | None
    message: str


@dataclass
class Divergence:
    """One parameter (FQN) whose param or grad hash differs at ``step`` on ``ranks``."""

    step: int
    fqn: str
    kind: str  # "param" | "grad"
    ranks: list[int]
    buckets: dict[str, dict[str, dict | None]]  # collective -> {"a": ref, "b": ref}


@dataclass
class FirstDivergence:
    step: int
    origin: str  # init | forward | backward | optimizer | param | loss | buffer | between | final
    grad_before_param: bool
    previous_step: int | None  # the step before, compared and matching (None: none captured)
    params: int
    grads: int | None
    ranks: list[int]
    loss_differs: bool | None
    explanation: str
    # what was compared and found, in those words ("loss equal, gradients differ at step 1"):
    # the label reports show; ``origin`` is its code, not a claim about which pass differs
    label: str | None = None
    # where in the step it happened, when that is not the step's own passes: between step()
    # calls ("after step 1's optimizer step, before or during step 2's forward"), or the final state
    phase: str | None = None
    # the random generators' states compared step by step (diff/rng.py compare_rng), or None
    rng: dict | None = None
    # the optimizers' group numbers compared step by step (diff/opt_numbers.py), or None
    opt_numbers: dict | None = None


@dataclass
class LossStep:
    step: int
    a: float | None  # the loss of the reference rank (lowest rank compared)
    b: float | None
    equal: bool | None  # bitwise equal on every rank compared (None: not captured)
    ranks_differing: int
    # the sum of every rank's loss: what a trainer that logs the global loss shows (torchtitan:
    # each rank records its share, local sum / global token count); None unless every rank of
    # the world has a loss at this step
    a_total: float | None = None
    b_total: float | None = None
    # every compared rank's loss, in ranks_compared order (the HTML report's per-rank lines)
    a_ranks: list | None = None
    b_ranks: list | None = None

    def shown(self, ranks: list[int], rank: int | None) -> tuple[int | None, object, object]:
        """(rank, A's loss, B's loss) for a one-row-per-step table: ``rank``'s (the lowest
        compared), unless the loss differs at this step and ``rank``'s two values are equal;
        then the first rank whose values differ, so a row marked as differing shows the
        difference."""
        if self.equal is False and _same_float(self.a, self.b):
            for r, x, y in zip(ranks, self.a_ranks or [], self.b_ranks or []):
                if not _same_float(x, y):
                    return r, x, y
        return rank, self.a, self.b

    def delta(self, ranks: list[int], rank: int | None) -> float | None:
        """(B - A) / |A| of the shown rank's loss (None: not both numbers, or A is 0)."""
        _, x, y = self.shown(ranks, rank)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
            return None
        return (y - x) / abs(x) if x else None


def _same_float(x, y) -> bool:
    """Bitwise the same number (or both missing)."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
        return x is None and y is None
    return struct.pack("<d", float(x)) == struct.pack("<d", float(y))


@dataclass
class LossComparison:
    captured: bool
    rank: int | None
    first_divergent_step: int | None
    steps: list[LossStep]
    # B's loss = A's x 2**factor bitwise at every step and rank (diff/loss_factor.py): the
    # losses were compared as scaled; None otherwise
    factor: int | None = None


@dataclass
class CaptureWarning:
    """A warning capture recorded on some ranks of one side (meta.json ``capture.warnings``)."""

    side: str  # "a" | "b"
    ranks: list[int]
    message: str


@dataclass
class DiffResult:
    a: ComparedRun
    b: ComparedRun
    verdict: str  # match | hash_mismatch | incomplete
    incomplete: list[str]  # why the data is incomplete (empty: complete)
    world_size: int | None
    ranks_compared: list[int]
    steps_compared: list[int]
    params_compared: int
    kinds_compared: list[str]  # ["param"] or ["param", "grad"]
    params_only_in_a: list[str]
    params_only_in_b: list[str]
    first_divergent_step: int | None
    first_divergence: FirstDivergence | None
    divergent: list[Divergence]
    per_step: list[StepCount]
    loss: LossComparison
    order: OrderComparison
    problems: list[Problem] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    # what capture said while recording (meta.json ``capture.warnings``), per side and message
    warnings: list[CaptureWarning] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    bucketing: dict = field(default_factory=dict)  # parity.diff.bucket_summary.summarize_pair
    # ``--at``: parity.diff.reduction.ReductionPrediction (None: no topology asked)
    reduction_order: object | None = None
    # the size of the differences, from the figures next to each hash (parity/diff/magnitude.py):
    # summaries, never part of the verdict; {} when nothing diverged
    magnitude: dict = field(default_factory=dict)
    # the state the runs ended with (parity.diff.final_state.FinalComparison.to_dict)
    final_state: dict = field(default_factory=dict)
    # what neither side recorded (steps both sampled out, gradients or loss neither has):
    # said on the verdict line, never a reason for exit 3 (engine._not_recorded)
    not_recorded: list[str] = field(default_factory=list)
    # ``--align-steps`` (parity.diff.align.Alignment.to_dict): None when steps were compared by
    # number without being asked
    align: dict | None = None
    # the first step whose optimizers' classes or flags differ (parity/diff/opt_impl.py), with
    # its verdict-line ``words``; None when they agree or were not recorded
    opt_impl: dict | None = None

    # -- policy (parity.policy owns the rule and the words)
    def exit_code(self, fail_on: str = "hash") -> int:
        """0 parity holds under ``fail_on``, 1 it does not, 3 data incomplete (docs/diff.md)."""
        return policy.pair_code(self.verdict, self.order.verdict, bool(self.incomplete), fail_on,
                                reduction_state({"order": {"consequences": self.order.consequences,
                                                           "notes": self.order.notes},
                                                 "reduction_order": self._reduction_dict()}),
                                policy.structure_only({"verdict": self.order.verdict,
                                                       "notes": self.order.notes,
                                                       "structure": self.order.structure}))

    def to_dict_reduction(self) -> dict | None:
        """``reduction_order`` as in the JSON (None: no ``--at``)."""
        return self._reduction_dict()

    def _reduction_dict(self) -> dict | None:
        return None if self.reduction_order is None else self.reduction_order.to_dict()

    def judge(self, fail_on: str = "hash") -> policy.Verdict:
        """The verdict line's parts under ``fail_on`` (rendered by every report alike)."""
        fd = self.first_divergence
        return policy.judge_pair({
            "verdict": self.verdict, "incomplete": self.incomplete,
            "kinds_compared": self.kinds_compared, "loss": {"captured": self.loss.captured,
                                                    "factor": self.loss.factor},
            "steps_compared": self.steps_compared, "ranks_compared": self.ranks_compared,
            "params_compared": self.params_compared, "first_divergent_step":
            self.first_divergent_step, "first_divergence": None if fd is None else
            {"ranks": list(fd.ranks), "origin": fd.origin, "label": fd.label, "phase": fd.phase,
             "params": fd.params, "grads": fd.grads, "opt_numbers": fd.opt_numbers},
            "final_state": self.final_state, "not_recorded": self.not_recorded,
            "align": self.align, "opt_impl": self.opt_impl,
            "order": {"verdict": self.order.verdict, "first_bucket": self.order.first_bucket,
                      "consequences": self.order.consequences, "notes": self.order.notes,
                      "compared": self.order.compared, "structure": self.order.structure},
            "reduction_order": self._reduction_dict(),
            "params_only_in_a": self.params_only_in_a, "params_only_in_b": self.params_only_in_b,
            # the same words as the JSON-fed verdict (sweep reports, HTML): capture warnings
            "warnings": [{"side": w.side, "message": w.message} for w in self.warnings],
        }, fail_on)

    # -- serialization
    def to_dict(self) -> dict:
        o = self.order
        return {
            "schema_version": self.schema_version,
            "verdict": self.verdict,
            "status": policy.status(self.verdict, self.order.verdict),
            "incomplete": list(self.incomplete),
            "not_recorded": list(self.not_recorded),
            "align": None if self.align is None else dict(self.align),
            "opt_impl": self.opt_impl,
            "a": _side_dict(self.a),
            "b": _side_dict(self.b),
            "world_size": self.world_size,
            "ranks_compared": list(self.ranks_compared),
            "steps_compared": list(self.steps_compared),
            "params_compared": self.params_compared,
            "kinds_compared": list(self.kinds_compared),
            "params_only_in_a": list(self.params_only_in_a),
            "params_only_in_b": list(self.params_only_in_b),
            "first_divergent_step": self.first_divergent_step,
            "first_divergence": None if self.first_divergence is None else {
                "step": self.first_divergence.step, "origin": self.first_divergence.origin,
                "grad_before_param": self.first_divergence.grad_before_param,
                "previous_step": self.first_divergence.previous_step,
                "params": self.first_divergence.params, "grads": self.first_divergence.grads,
                "ranks": list(self.first_divergence.ranks),
                "loss_differs": self.first_divergence.loss_differs,
                "explanation": self.first_divergence.explanation,
                "label": self.first_divergence.label,
                "phase": self.first_divergence.phase,
                "rng": self.first_divergence.rng,
                "opt_numbers": self.first_divergence.opt_numbers,
            },
            "divergent": [{"step": d.step, "fqn": d.fqn, "kind": d.kind, "ranks": list(d.ranks),
                           "buckets": d.buckets} for d in self.divergent],
            "per_step": [{"step": c.step, "params": c.params, "grads": c.grads, "ranks": c.ranks,
                          "exact": c.exact} for c in self.per_step],
            "loss": {
                "captured": self.loss.captured, "rank": self.loss.rank,
                "first_divergent_step": self.loss.first_divergent_step,
                "factor": self.loss.factor,
                "steps": [{"step": s.step, "a": s.a, "b": s.b, "equal": s.equal,
                           "ranks_differing": s.ranks_differing, "a_total": s.a_total,
                           "b_total": s.b_total, "a_ranks": s.a_ranks, "b_ranks": s.b_ranks}
                          for s in self.loss.steps],
            },
            "order": {
                "verdict": o.verdict, "a_source": o.a_source, "b_source": o.b_source,
                "rank": o.rank, "compared": list(o.compared),
                "first_bucket": o.first_bucket,
                "pairs": [_pair_dict(p) for p in o.pairs],
                "counts": o.counts, "notes": list(o.notes),
                "rank_disagreements": {k: list(v) for k, v in o.rank_disagreements.items()},
                "eager": {k: [dict(x) for x in v] for k, v in o.eager.items()},
                "consequences": dict(o.consequences),
                "structure": [dict(x) for x in o.structure],
            },
            "reduction_order": self._reduction_dict(),
            "problems": [{"side": p.side, "message": p.message} for p in self.problems],
            "warnings": [{"side": w.side, "ranks": list(w.ranks), "message": w.message}
                         for w in self.warnings],
            "stats": dict(self.stats),
            "bucketing": dict(self.bucketing),
            "magnitude": dict(self.magnitude),
            "final_state": dict(self.final_state),
        }

    def write_json(self, path: str | Path) -> None:
        """Write ``to_dict()`` atomically (temporary file + rename)."""
        write_json_atomic(path, self.to_dict(), indent=None if len(self.divergent) > 200 else 1)


def _side_dict(s: ComparedRun) -> dict:
    return {"path": s.path, "world_size": s.world_size, "ranks": list(s.ranks),
            "missing_ranks": list(s.missing_ranks), "steps": list(s.steps), "status": s.status,
            "bucket_source": s.bucket_source}


def _pair_dict(p: BucketPair) -> dict:
    return {"collective": p.collective, "verdict": p.verdict,
            "a": {"buckets": list(p.a), "groups": list(p.a_groups)},
            "b": {"buckets": list(p.b), "groups": list(p.b_groups)},
            "position": p.position, "a_entry": p.a_entry, "b_entry": p.b_entry,
            "detail": p.detail, "moved": list(p.moved), "consequence": p.consequence,
            "rows": list(p.rows)}


def load_diff_json(path: str | Path) -> dict:
    """A diff JSON written by ``write_json`` (as a dict); ParityError if it is not one."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ParityError(f"{path}: not a readable diff JSON ({e.__class__.__name__})") from None
    if not isinstance(obj, dict) or obj.get("schema_version") != SCHEMA_VERSION:
        raise ParityError(f"{path}: not a schema-{SCHEMA_VERSION} diff JSON")
    return obj


# ---------------------------------------------------------------------------- from the JSON


@dataclass
class RecordedPrediction:
    """``reduction_order`` as a diff JSON recorded it (``from_dict`` does not rebuild the
    topology): what ``DiffResult.exit_code``, ``judge`` and ``to_dict`` need of it."""

    data: dict | list  # a list: several topologies (``--at 1x8,8x8``)

    def to_dict(self) -> dict | list:
        return [dict(x) for x in self.data] if isinstance(self.data, list) else dict(self.data)


def from_dict(d: dict) -> DiffResult:
    """A diff JSON (``to_dict``'s shape: ``--json``, a sweep cell's ``diff``) typed again, so the
    reports read one model whether the result was just computed or read back. Tolerant as the
    reports always were of the dict: a key left out reads as None (empty for lists), an entry
    that is not an object is skipped; ``reduction_order`` stays as recorded
    (:class:`RecordedPrediction`)."""
    def obj(x) -> dict:
        return x if isinstance(x, dict) else {}

    def objs(x) -> list[dict]:
        return [e for e in x or [] if isinstance(e, dict)]

    def side(s: dict) -> ComparedRun:
        return ComparedRun(s.get("path"), s.get("world_size"), s.get("ranks") or [],
                           s.get("missing_ranks") or [], s.get("steps") or [], s.get("status"),
                           s.get("bucket_source"))

    fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else None
    loss, order = obj(d.get("loss")), obj(d.get("order"))
    reduction = d.get("reduction_order")
    return DiffResult(
        a=side(obj(d.get("a"))), b=side(obj(d.get("b"))), verdict=d.get("verdict"),
        incomplete=d.get("incomplete") or [], world_size=d.get("world_size"),
        not_recorded=[str(x) for x in d.get("not_recorded") or []],
        ranks_compared=d.get("ranks_compared") or [], steps_compared=d.get("steps_compared") or [],
        params_compared=d.get("params_compared"), kinds_compared=d.get("kinds_compared") or [],
        params_only_in_a=d.get("params_only_in_a") or [],
        params_only_in_b=d.get("params_only_in_b") or [],
        first_divergent_step=d.get("first_divergent_step"),
        first_divergence=None if fd is None else FirstDivergence(
            fd.get("step"), fd.get("origin"), fd.get("grad_before_param"),
            fd.get("previous_step"), fd.get("params"), fd.get("grads"), fd.get("ranks") or [],
            fd.get("loss_differs"), fd.get("explanation"), fd.get("label"), fd.get("phase"),
            fd.get("rng") if isinstance(fd.get("rng"), dict) else None,
            fd.get("opt_numbers") if isinstance(fd.get("opt_numbers"), dict) else None),
        divergent=[Divergence(x.get("step"), x.get("fqn"), x.get("kind"), x.get("ranks") or [],
                              {coll: sides for coll, sides in obj(x.get("buckets")).items()
                               if isinstance(sides, dict)})
                   for x in objs(d.get("divergent"))],
        per_step=[StepCount(x.get("step"), x.get("params"), x.get("grads"), x.get("ranks"),
                            x.get("exact")) for x in objs(d.get("per_step"))],
        loss=LossComparison(loss.get("captured"), loss.get("rank"),
                            loss.get("first_divergent_step"),
                            [LossStep(x.get("step"), x.get("a"), x.get("b"), x.get("equal"),
                                      x.get("ranks_differing"), x.get("a_total"),
                                      x.get("b_total"), x.get("a_ranks"), x.get("b_ranks"))
                             for x in objs(loss.get("steps"))],
                            loss.get("factor") if isinstance(loss.get("factor"), int) else None),
        order=OrderComparison(
            order.get("verdict"), order.get("a_source"), order.get("b_source"),
            order.get("rank"), [_pair_from_dict(p) for p in objs(order.get("pairs"))],
            order.get("first_bucket"), order.get("counts") or {}, order.get("notes") or [],
            order.get("rank_disagreements") or {}, order.get("compared") or [],
            order.get("eager") or {}, order.get("consequences") or {},
            order.get("structure") or []),
        problems=[Problem(x.get("side"), x.get("message")) for x in objs(d.get("problems"))],
        stats=d.get("stats") or {},
        warnings=[CaptureWarning(x.get("side"), x.get("ranks"), x.get("message"))
                  for x in objs(d.get("warnings"))],
        schema_version=d.get("schema_version", SCHEMA_VERSION), bucketing=d.get("bucketing") or {},
        reduction_order=RecordedPrediction(reduction) if isinstance(reduction, (dict, list))
        else None,
        magnitude=obj(d.get("magnitude")), final_state=obj(d.get("final_state")),
        align=d.get("align") if isinstance(d.get("align"), dict) else None,
        opt_impl=d.get("opt_impl") if isinstance(d.get("opt_impl"), dict) else None)


def _pair_from_dict(p: dict) -> BucketPair:
    a, b = p.get("a") or {}, p.get("b") or {}
    return BucketPair(p.get("collective"), p.get("verdict"), a.get("buckets") or [],
                      b.get("buckets") or [], a.get("groups") or [], b.get("groups") or [],
                      position=p.get("position"), a_entry=p.get("a_entry"),
                      b_entry=p.get("b_entry"), detail=p.get("detail", ""),
                      moved=p.get("moved") or [], consequence=p.get("consequence"),
                      rows=p.get("rows") or [])
