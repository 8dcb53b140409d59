"""What a bucket difference can do to the numbers: its consequence class, and the words for it.

Why this exists: on gloo, or on one node, a bucket whose payload order changed gives the same
hashes, so a report that leads with "all_gather bucket 1 position 0" sends people after a
difference that can never change a value, while the reduce-scatter buckets that change sums on
a cluster hide further down. Every bucket difference is put in one of three classes
(docs/reduction-order.md), and every report leads with the most consequential one:

- ``reduction_structure``: a gradient reduced by a different number of collectives on the two
  sides (e.g. a chunked loss reduce-scatters lm_head's gradient once per chunk): every element
  is summed differently;
- ``reduction_order``: a reduce-scatter (or all-reduce) bucket whose payload order, offsets or
  partition differ: which NCCL channel an element lands in changes, and with it the rank order
  of its sum on a multi-node Ring ("sums may change");
- ``copy_only``: an all-gather bucket whose order or partition differ: a copy, values unchanged.

Pure functions on plain values (the diff's JSON), so that policy, diff and reports share them.
Standard library only.
"""

from __future__ import annotations

from parity.records import NORM_SUFFIX

COPY_ONLY, REDUCTION_ORDER, REDUCTION_STRUCTURE = (
    "copy_only", "reduction_order", "reduction_structure")
CLASSES = (COPY_ONLY, REDUCTION_ORDER, REDUCTION_STRUCTURE)  # least to most consequential
RANK = {c: i for i, c in enumerate(CLASSES)}
REDUCTIONS = (REDUCTION_ORDER, REDUCTION_STRUCTURE)
REDUCING = ("reduce_scatter", "all_reduce")

WORDS = {
    COPY_ONLY: "copy-only, values unchanged",
    REDUCTION_ORDER: "reduction order, sums may change",
    REDUCTION_STRUCTURE: "reduction structure, sums change",
}
TITLE = {COPY_ONLY: "copy-only", REDUCTION_ORDER: "reduction order",
         REDUCTION_STRUCTURE: "reduction structure"}


def classify(collective: str | None, verdict: str | None, structure: bool = False) -> str | None:
    """The class of one aligned bucket group (None when identical): ``structure`` says that a
    parameter of the group is reduced by a different number of collectives on the two sides."""
    if verdict in (None, "identical"):
        return None
    if collective in REDUCING:
        return REDUCTION_STRUCTURE if structure else REDUCTION_ORDER
    return COPY_ONLY


def lead_key(consequence: str | None, verdict: str | None, index: int) -> tuple:
    """Sort key putting the most consequential difference first: a reduction (order or
    structure) before a copy, then a payload-order or partition difference before a size-only
    one, then issue order."""
    return (0 if consequence in REDUCTIONS else 1 if consequence == COPY_ONLY else 2,
            0 if verdict in ("order_differs", "partition_differs") else 1, index)


def counts_phrase(counts: dict | None) -> str:
    """'6 reduction-order buckets (sums may change), 1 copy-only bucket (values unchanged)'."""
    if not isinstance(counts, dict):
        return ""
    parts = []
    for c in reversed(CLASSES):
        n = counts.get(c)
        if isinstance(n, int) and n:
            tail = {COPY_ONLY: "values unchanged", REDUCTION_ORDER: "sums may change",
                    REDUCTION_STRUCTURE: "sums change"}[c]
            parts.append(f"{n} {TITLE[c].replace(' ', '-')} bucket{'s' if n != 1 else ''} "
                         f"({tail})")
    return ", ".join(parts)


def predictions(ro) -> list[dict]:
    """``reduction_order`` as a list of per-topology objects: one object (``--at 8x8``), a list
    (``--at 1x8,8x8``), or nothing."""
    if isinstance(ro, dict):
        return [ro]
    if isinstance(ro, list):
        return [x for x in ro if isinstance(x, dict)]
    return []


def prediction_verdict(ro) -> str | None:
    """The prediction's verdict over every topology: ``differs`` if one differs, else
    ``unknown`` if one is unknown (or not a verdict), else ``same``; None without one."""
    vs = [x.get("verdict") for x in predictions(ro)]
    if not vs:
        return None
    if "differs" in vs:
        return "differs"
    return "same" if all(v == "same" for v in vs) else "unknown"


# how diff/buckets.py's detail of a bucket pair differing in its reduce ops or its group's ranks
# alone begins (the same bytes in the same places): the verdict line then says "bucket reduce
# op differs" or "bucket group differs" (policy.order_phrase)
OPS_ONLY = "same payloads and offsets; "

# an AtRisk's ``why`` other than "order", as the verdict line says it (a count before it)
_WHY = {"scaling": "by the reduce op's scaling", "dtype": "in another dtype",
        "structure": "by another number of collectives"}


def _one_prediction(ro: dict) -> str:
    risk = [x for x in ro.get("at_risk") or [] if isinstance(x, dict)]
    if ro.get("verdict") == "same":
        return "same sums predicted"
    if ro.get("verdict") == "differs":
        n = sum(int(x.get("elements") or 0) for x in risk)
        what = f"{n:,} elements of {len(risk)} parameter{'s' if len(risk) != 1 else ''} at risk"
        whys: dict = {}
        for x in risk:
            whys[x.get("why")] = whys.get(x.get("why"), 0) + 1
        other = [f"{k} {_WHY[w]}" for w, k in whys.items() if w in _WHY]
        norms = sum(1 for x in risk if str(x.get("fqn") or "").endswith(NORM_SUFFIX))
        if norms:  # a clip's total norm: its one ulp scales every gradient it clips
            other.append(f"{norms} gradient norm{'s' if norms != 1 else ''}, whose total "
                         "scales every clipped gradient")
        if other:  # not by the summation order alone: said, so that identical layouts read
            what += f" ({', '.join(other)})"  # as what they are
    else:
        unknown = [u for u in ro.get("unknown") or [] if isinstance(u, dict)]
        what = "unknown" + (f" ({unknown[0].get('reason')})" if unknown else "")
    unp = ro.get("unpredicted") or []
    if unp:
        what += f", {len(unp)} bucket{'s' if len(unp) != 1 else ''} not predicted"
    return what


def reduction_phrase(ro) -> str | None:
    """The prediction in a few words: 'reduction order at 8x8 (nccl-ring-cbd/1): 1,024 elements
    of 3 parameters at risk (an upper bound), for the captured model's bucket sizes'; several
    topologies one after the other (None without a prediction). Where the runs were emulated at
    another topology, both are said; where at this one, what the emulation showed."""
    ros = predictions(ro)
    if not ros:
        return None
    from parity.nccl.probe_file import topology_label  # a probe's file: name + agreement

    parts = []
    for k, x in enumerate(ros):
        topo = (x.get("topology") or {}).get("spec") if isinstance(x.get("topology"),
                                                                   dict) else None
        label = topology_label(topo, x.get("topology_file"))
        head = f"reduction order at {label} ({x.get('model')})" if k == 0 else f"at {label}"
        parts.append(f"{head}: {_one_prediction(x)}")
    what = "; ".join(parts)
    if any(x.get("verdict") == "differs" for x in ros):
        what += " (an upper bound)"
    what += ", for the captured model's bucket sizes"
    first = ros[0]
    emu = first.get("emulated")
    obs = next((x.get("observed") for x in ros if isinstance(x.get("observed"), dict)), None)
    if obs and not obs.get("diverged"):
        what += f"; emulated at {obs.get('topology')}: no gradient diverged"
    elif obs:
        missed = obs.get("not_predicted") or []
        what += (f"; emulated at {obs.get('topology')}: {obs.get('diverged')} gradient(s) "
                 f"diverged at step {obs.get('step')}, "
                 + ("every one predicted" if not missed else
                    f"{len(missed)} NOT predicted ({', '.join(map(str, missed[:3]))})"))
    elif isinstance(emu, str):
        what += f"; hashes compared under emulation at {emu}"
    return what


# a side whose manifests hold no reduction of any kind (recorded with --no-manifests, or a rank
# that wrote none): how it reduced its gradients is not known, never "by zero collectives"
# (diff/reduction.py notes it in ``order.notes``; policy reads it back)
BLIND = " recorded no reduction collectives (no bucket manifests): how its gradients were " \
        "reduced is not known"


def blind_note(side: str) -> str:
    """'B recorded no reduction collectives (...)'."""
    return f"{side}{BLIND}"


def blind_side(order: dict) -> str | None:
    """"A" / "B" when the order comparison notes that side recorded no reduction at all."""
    for n in order.get("notes") or ():
        if isinstance(n, str) and n[:1] in ("A", "B") and n[1:].startswith(BLIND):
            return n[0]
    return None


def reduction_state(d: dict) -> str | None:
    """What policy ``reduction`` makes of a diff (``DiffResult.to_dict()`` or a cell's diff):
    ``fails`` (a reduction difference, predicted at risk at some topology when a prediction was
    asked), ``unknown`` (a reduction difference the prediction could not derive), ``tolerated``
    (copy-only differences, or reductions predicted to give the same sums everywhere), None (a
    diff written without consequence classes)."""
    order = d.get("order") if isinstance(d.get("order"), dict) else {}
    counts = order.get("consequences")
    if not isinstance(counts, dict):
        return None
    if blind_side(order):  # a side's reductions were not recorded: unproven
        return "unknown"
    if not any(counts.get(c) for c in REDUCTIONS):
        # the layouts reduce alike, but a prediction asked for can still put elements at risk
        # (the two sides' reduce ops scale differently: AVG against SUM and a divide, round
        # 11a's forced-SUM pair at 3x8 HELD "tolerated: 165 elements ... at risk"), or leave
        # it unknown (twins whose ops differ on one NVSwitch node, where the SUM may run NVLS)
        predicted = prediction_verdict(d.get("reduction_order"))
        return {"differs": "fails", "unknown": "unknown"}.get(predicted, "tolerated")
    if _blind_structure(order):
        return "unknown"
    verdict = prediction_verdict(d.get("reduction_order"))
    if verdict is None:
        return "fails"
    return {"differs": "fails", "same": "tolerated"}.get(verdict, "unknown")


def _blind_structure(order: dict) -> bool:
    """A diff written before parity told a side without manifests from one that reduces nothing:
    its only reduction difference is a structure one where every gradient is reduced by zero
    collectives on a side that recorded no bucket layouts (``X_source`` null). How that side
    reduced is not known: unproven, never a failure."""
    counts = order.get("consequences") if isinstance(order.get("consequences"), dict) else {}
    structure = [x for x in order.get("structure") or [] if isinstance(x, dict)]
    if counts.get(REDUCTION_ORDER) or not structure:
        return False
    return any(order.get(f"{side}_source") is None and all(not x.get(side) for x in structure)
               for side in ("a", "b"))


def order_suffix(order: dict) -> str:
    """What follows the bucket-order phrase on the verdict line: the lead's class in words and
    how many differing buckets fall in each class, e.g. ': reduction order, sums may change
    (6 reduction order (sums may change), 1 copy-only (values unchanged))'."""
    fb = order.get("first_bucket") if isinstance(order.get("first_bucket"), dict) else {}
    lead = fb.get("consequence")
    out = f": {WORDS[lead]}" if lead in WORDS else ""
    counts = order.get("consequences") if isinstance(order.get("consequences"), dict) else {}
    if sum(v for v in counts.values() if isinstance(v, int)) > 1 or (
            counts and lead not in counts):
        out += f" [{counts_phrase(counts)}]"
    return out
