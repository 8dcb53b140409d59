"""Which implementation each stepping optimizer is (steps.jsonl ``opt_impl``).

Why: two runs with the same hyperparameters may step optimizers implemented otherwise: another
class (Adam against AdamW), another kernel (``foreach``, ``fused``, ``capturable``,
``differentiable``) or another rule behind a flag (``maximize``, ``amsgrad``, ``nesterov``,
``decoupled_weight_decay``). The group numbers (opt_numbers.py) leave booleans, None and strings
out, so such a pair read "gradients equal, parameters differ" with "the optimizers' group
numbers are equal: not another learning rate" and nothing more, and a pair whose values happened
to be bitwise equal on this device (``foreach`` against the for-loop on the CPU, Adam against
AdamW at weight decay 0) HELD without a word, though the kernels may round otherwise elsewhere
(docs/reliability.md, "Round 15b"). The diff names them (parity/diff/opt_impl.py).

What is read, in the optimizer's post-hook with the group numbers (same optimizers, same
order): ``{"class": "module.QualName", "flags": [{key: bool | None | str}, ...one per group]}``.
No tensor is touched; any failure: nothing recorded for that optimizer.
"""

from __future__ import annotations

__all__ = ["optimizer_impl"]


def optimizer_impl(opt, flags: list[dict] | None = None) -> dict | None:
    """The class and the non-number entries of each param group of ``opt`` (``flags``: those
    entries as opt_numbers.group_entries read them in its one pass; else read here), or None."""
    try:
        cls = type(opt)
        if flags is None:
            flags = []
            for g in opt.param_groups:
                flags.append({k: g[k] for k in sorted(k for k in g if isinstance(k, str)
                                                      and k != "params")
                              if g[k] is None or isinstance(g[k], (bool, str))})
        return {"class": f"{cls.__module__}.{cls.__qualname__}", "flags": flags}
    except Exception:  # noqa: BLE001 - a wrapper without param_groups: nothing said
        return None
