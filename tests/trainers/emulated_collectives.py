"""Every kind of reduction a trainer can reach, each saved with its inputs so that a test can
recompute it: dist.reduce_scatter_tensor and dist.all_reduce (SUM and AVG, fp32 and bf16), the
functional reduce-scatter inside a torch.compile(aot_eager) graph, and DTensor redistributions
(Partial -> Shard, Partial -> Replicate). Ends with one optimizer step (so capture records).
It imports nothing from parity.

    torchrun --standalone --nproc_per_node 4 tests/trainers/emulated_collectives.py OUT_DIR

Inputs are torch.randn(..., generator seeded 1000 + rank + 17 * case), so a test can rebuild
every rank's input; each rank writes OUT_DIR/rank{R}.pt: {case: output tensor}.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

COUNT = 5000  # per-rank elements of a reduce-scatter: several channels at channels=4


def case_input(case: int, rank: int, numel: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank + 17 * case)
    return torch.randn(numel, generator=g).to(dtype)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    n = world * COUNT
    for case, (op, dtype) in enumerate([(dist.ReduceOp.SUM, torch.float32),
                                        (dist.ReduceOp.AVG, torch.float32),
                                        (dist.ReduceOp.SUM, torch.bfloat16),
                                        (dist.ReduceOp.AVG, torch.bfloat16)]):
        o = torch.empty(COUNT, dtype=dtype)
        dist.reduce_scatter_tensor(o, case_input(case, rank, n, dtype), op=op)
        out[f"rs{case}"] = o
        t = case_input(10 + case, rank, n, dtype)
        dist.all_reduce(t, op=op)
        out[f"ar{case}"] = t

    @torch.compile(backend="aot_eager", fullgraph=True)
    def compiled(x):
        y = funcol.reduce_scatter_tensor(x * 1.0, "sum", 0, dist.group.WORLD)
        return y + 0.0

    out["compiled_rs"] = compiled(case_input(20, rank, n, torch.float32))

    mesh = init_device_mesh("cpu", (world,))
    p = DTensor.from_local(case_input(21, rank, n, torch.float32), mesh, [Partial()])
    out["dtensor_rs"] = p.redistribute(mesh, [Shard(0)]).to_local()
    p = DTensor.from_local(case_input(22, rank, n, torch.float32), mesh, [Partial()])
    out["dtensor_ar"] = p.redistribute(mesh, [Replicate()]).to_local()

    # sub-groups (HSDP's replicate groups on 2x2): {0, 2} and {1, 3}, every rank creates both
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    half = 2 * COUNT
    o = torch.empty(COUNT, dtype=torch.float32)
    dist.reduce_scatter_tensor(o, case_input(30, rank, half, torch.float32), group=mine)
    out["group_rs"] = o
    t = case_input(31, rank, half, torch.float32)
    dist.all_reduce(t, group=mine)
    out["group_ar"] = t

    os.makedirs(sys.argv[1], exist_ok=True)
    torch.save({k: v.clone() for k, v in out.items()}, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    (w * 2).sum().backward()
    opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
