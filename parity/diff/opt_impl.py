"""What the diff says of the optimizers' implementations (steps.jsonl ``opt_impl``,
capture/opt_impl.py): their classes and the flags of their param groups.

Why (docs/reliability.md, "Round 15b"): the same hyperparameters stepped by optimizers
implemented otherwise (``fused=True`` against the for-loop, ``maximize``, ``amsgrad``) read
"gradients equal, parameters differ" with "the group numbers are equal: not another learning
rate", naming no cause; and a pair whose values happen to be bitwise equal here (``foreach``
against the for-loop on the CPU, Adam against AdamW at weight decay 0) HELD without a word,
though another device's kernels may round otherwise.

What is said: at a first divergence of the update (origin ``param``/``optimizer``), the flag
or class that differs is named in the label and as the likely cause in the explanation; at
another divergence it is said in the explanation; with every hash equal it is never a FAIL (the
flag changed no number here) but is said on the verdict line among what the policy tolerates
(policy.py), with whether it is a kernel choice (may differ on another device) or another
update rule. Old runs (no ``opt_impl``) or one side only: nothing said.
"""

from __future__ import annotations

from parity.text import ranges

__all__ = ["impl_by_rank", "compare_impl", "impl_words", "impl_phrase"]

# flags that choose how the same update is computed (the kernels), not what it is
KERNEL_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def impl_by_rank(lst) -> dict[int, dict[int, list]]:
    """``{rank: {step: [optimizer dicts]}}`` of a side's RankData (steps with ``opt_impl``)."""
    return {x.rank: {s: rec["opt_impl"] for s, rec in x.steps.items()
                     if isinstance(s, int) and isinstance(rec, dict)
                     and isinstance(rec.get("opt_impl"), list)} for x in lst}


# A flag one side's torch does not have (a run of torch 2.11 against 2.13: an option added in
# between) computes as the option left off; torch adds options off by default (False, None).
_OFF = (False, None)


def _short(cls) -> str:
    return str(cls).rsplit(".", 1)[-1]


def _differences(x: list, y: list) -> list[dict]:
    """``{optimizer, group, key, a, b}`` of two steps' optimizer lists (key ``class`` for the
    class, ``optimizers`` for their count); a flag on one side only is ``"absent"`` there, and
    no difference where the other side has it off (``_OFF``: another torch's option set)."""
    out = []
    if len(x) != len(y):
        out.append({"optimizer": None, "group": None, "key": "optimizers",
                    "a": len(x), "b": len(y)})
    for i, (ox, oy) in enumerate(zip(x, y)):
        if not (isinstance(ox, dict) and isinstance(oy, dict)):
            continue
        if ox.get("class") != oy.get("class"):
            out.append({"optimizer": i, "group": None, "key": "class",
                        "a": _short(ox.get("class")), "b": _short(oy.get("class"))})
        for g, (fx, fy) in enumerate(zip(ox.get("flags") or [], oy.get("flags") or [])):
            if not (isinstance(fx, dict) and isinstance(fy, dict)):
                continue
            for k in sorted(set(fx) | set(fy)):
                a, b = fx.get(k, "absent"), fy.get(k, "absent")
                if "absent" in (a, b) and (a in _OFF or b in _OFF):
                    continue  # an option one side's torch lacks, off on the other: the same
                if a != b and not any(d["key"] == k and d["optimizer"] == i for d in out):
                    out.append({"optimizer": i, "group": g, "key": k, "a": a, "b": b})
    return out


def compare_impl(a: dict, b: dict, ranks: list[int]) -> dict | None:
    """The first step (over the compared ranks) whose optimizers' classes or flags differ:
    ``{"first_differs": step, "ranks": [...], "differences": [...], "kernel_only": bool}``;
    None when neither side recorded them on a common step or nothing differs."""
    common = [set(a.get(r, {})) & set(b.get(r, {})) for r in ranks]
    if not common or not any(common):
        return None
    for s in sorted(set.union(*common)):
        bad, diffs = [], []
        for r in ranks:
            x, y = a.get(r, {}).get(s), b.get(r, {}).get(s)
            if x is not None and y is not None and x != y:  # (equal lists: C-level, cheap)
                d = _differences(x, y)
                if d:
                    diffs = diffs or d
                    bad.append(r)
        if bad:
            return {"first_differs": s, "ranks": bad, "differences": diffs,
                    "kernel_only": all(d["key"] in KERNEL_FLAGS for d in diffs)}
    return None


def _shown(v) -> str:
    return {None: "None (the default)", "absent": "absent"}.get(v, repr(v)) \
        if v is None or v == "absent" else repr(v)


def difference_text(cmp: dict, limit: int = 3) -> str:
    """``fused None (the default) against True (Adam, group 0)``, the first ``limit``."""
    parts = []
    for d in cmp["differences"][:limit]:
        if d["key"] == "optimizers":
            parts.append(f"{d['a']} stepping optimizer(s) against {d['b']}")
        elif d["key"] == "class":
            parts.append(f"{d['a']} against {d['b']}")
        else:
            parts.append(f"{d['key']} {_shown(d['a'])} against {_shown(d['b'])}"
                         + (f" (group {d['group']})" if d["group"] else ""))
    more = len(cmp["differences"]) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


def _first_key(cmp: dict) -> str:
    d = cmp["differences"][0]
    return {"class": "class", "optimizers": "count"}.get(d["key"], d["key"])


def impl_words(cmp: dict | None, origin: str | None, step: int) -> tuple[str, str]:
    """(the label's addition, the explanation's addition) at a first divergence at ``step``
    of ``origin``; empty strings when nothing differs."""
    if cmp is None or cmp["first_differs"] > step:
        return "", ""
    what = ("the same update computed by other kernels" if cmp["kernel_only"]
            else "another update rule")
    head = (f"; the optimizers' implementation differs from step {cmp['first_differs']} on "
            f"rank(s) {ranges(cmp['ranks'])}: {difference_text(cmp)} ({what})")
    if origin in ("param", "optimizer"):
        return (f"optimizer {_first_key(cmp)} differs",
                head + ": the likely cause of parameters that differ from gradients that match")
    return "", head


def impl_phrase(cmp: dict | None) -> str:
    """The verdict line's words where every hash matched (tolerated, never a FAIL)."""
    if cmp is None:
        return ""
    why = ("other kernels: equal here, may round otherwise on another device or size"
           if cmp["kernel_only"] else "another update rule that changed no value here")
    return (f"optimizer implementation differs from step {cmp['first_differs']} "
            f"({difference_text(cmp, 2)}; {why})")
