"""What a consistent payload reorder does on gloo itself (the claim "on gloo a reorder changes no
value", measured): two payloads P, Q reduced as [P, Q] and as [Q, P] (the same values), element
by element, by a reduce-scatter (each rank's row [P_d, Q_d]) and by an all-reduce of one flat
buffer, over 20 random layouts. It imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/gloo_reorder.py OUT.json

Rank 0 writes OUT.json: {"world", "reduce_scatter": [elements differing per layout, summed over
the ranks], "reduce_scatter_elements", "all_reduce": [per layout], "all_reduce_elements"}.
"""

import json
import sys

import torch
import torch.distributed as dist

LAYOUTS = 20


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    out = {"world": w, "reduce_scatter": [], "reduce_scatter_elements": 0, "all_reduce": [],
           "all_reduce_elements": 0}
    for k in range(LAYOUTS):
        g = torch.Generator().manual_seed(1000 * k + r)
        n_p, n_q = 3001 + 17 * k, 1998 + 7 * k + k % 3  # per-rank rows of two "gradients"
        p = torch.randn(w, n_p, generator=g)
        q = torch.randn(w, n_q, generator=g)
        pq = torch.cat([p, q], dim=1).reshape(-1)  # rank d's row: [P_d, Q_d]
        qp = torch.cat([q, p], dim=1).reshape(-1)  # the same payloads, reordered
        oa, ob = torch.empty(n_p + n_q), torch.empty(n_p + n_q)
        dist.reduce_scatter_tensor(oa, pq)
        dist.reduce_scatter_tensor(ob, qp)
        n = torch.tensor([(oa != torch.cat([ob[n_q:], ob[:n_q]])).sum().item()])
        dist.all_reduce(n)  # integers: exact in any order
        out["reduce_scatter"].append(int(n.item()))
        out["reduce_scatter_elements"] += w * (n_p + n_q)
        fa, fb = torch.cat([p.reshape(-1), q.reshape(-1)]), torch.cat([q.reshape(-1), p.reshape(-1)])
        dist.all_reduce(fa)
        dist.all_reduce(fb)
        out["all_reduce"].append(int((fa != torch.cat([fb[q.numel():], fb[:q.numel()]])).sum()))
        out["all_reduce_elements"] += fa.numel()
    if r == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
