"""Which summation order over the ranks' inputs reproduces a sum's bits.

When NCCL's result for an element differs from the model's, the model's order was wrong; this
module finds the orders that do give NCCL's bits, so the report can say *how* it was wrong (the
element sits on another channel than modelled, its channel's ring differs, the chunk had another
owner, or no ring order at all reproduces it: another algorithm).

Candidates, in the order they are tried and reported:

1. every ring order the topology has: for every channel c and every rank r, the order in which
   channel c's ring sums rank r's segment (``sum_order(ring_c, r)``, the order a reduce-scatter
   or an all-reduce chunk owned by r is built in);
2. the same for every extra ring list given (the emulated cluster's own rings, other families);
3. with at most :data:`EXHAUSTIVE_MAX` ranks, every order at all (n!/2 of them: the first
   addition commutes), so a match is found whatever the algorithm was, if it is a sequential sum.

A sum is computed as the model computes it (``ring_sum`` of parity.capture.nccl_emulation): one
addition at a time, each rounded to the dtype.
"""

from __future__ import annotations

import itertools

from parity.nccl import canonical_order, sum_order

EXHAUSTIVE_MAX = 8  # 8! / 2 = 20,160 orders, one vectorized pass each step
MAX_NAMED = 6  # matches listed in a report


def ring_candidates(rings, label: str = "channel", first_owner: int | None = None,
                    seen: set | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(label, order) for every channel ring and owner, distinct orders only (the first
    addition commutes: ``canonical_order``; ``seen`` is shared between calls). The orders of
    ``first_owner`` (the rank whose segment it is) come first: they are the likely ones."""
    out = []
    seen = set() if seen is None else seen
    pairs = [(c, o) for c, ring in enumerate(rings) for o in ring]
    pairs.sort(key=lambda p: p[1] != first_owner)
    for c, owner in pairs:
        order = sum_order(tuple(rings[c]), owner)
        key = canonical_order(order)
        if key in seen:
            continue
        seen.add(key)
        out.append((f"{label} {c}'s ring, owner {owner}", order))
    return out


def sequential_sums(vals, orders):
    """The sequential sum of ``vals`` (a 1-d tensor, one value per rank, in the dtype) in
    every order of ``orders`` (a list of rank tuples), one rounding per addition."""
    import torch

    idx = torch.tensor(orders, dtype=torch.long)
    acc = vals[idx[:, 0]].clone()
    for k in range(1, idx.shape[1]):
        acc = acc + vals[idx[:, k]]
    return acc


def _bits(t):
    import torch

    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def find_orders(vals, observed, candidates: list[tuple[str, tuple[int, ...]]]) -> dict:
    """Orders that reproduce ``observed`` (a 0-d tensor in the dtype) from ``vals``.

    Returns {"named": [labels of matching candidates], "orders": [matching orders, up to
    MAX_NAMED, as lists], "tried": orders tried, "exhaustive": whether every order was tried,
    "matches": how many orders matched in all}."""
    n = int(vals.shape[0])
    obs = _bits(observed.reshape(1))[0].item()
    named, orders, tried, matches = [], [], 0, 0
    if candidates:
        sums = sequential_sums(vals, [list(o) for _, o in candidates])
        hit = (_bits(sums) == obs).tolist()
        tried += len(candidates)
        for (label, order), ok in zip(candidates, hit):
            if ok:
                named.append(label)
                if len(orders) < MAX_NAMED:
                    orders.append(list(order))
    exhaustive = 2 <= n <= EXHAUSTIVE_MAX
    if exhaustive:
        perms = [p for p in itertools.permutations(range(n)) if p[0] < p[1]]
        sums = sequential_sums(vals, perms)
        ok = (_bits(sums) == obs).nonzero().flatten().tolist()
        tried = len(perms)
        matches = len(ok)
        have = {canonical_order(tuple(o)) for o in orders}
        for i in ok:
            if len(orders) >= MAX_NAMED:
                break
            if canonical_order(perms[i]) not in have:
                orders.append(list(perms[i]))
    else:
        matches = len(named)
    return {"named": named[:MAX_NAMED], "orders": orders, "tried": tried,
            "exhaustive": exhaustive, "matches": matches}
