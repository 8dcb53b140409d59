"""A plain FSDP2 trainer used by the capture tests. It imports nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/plain_fsdp2.py

Knobs (environment):
  PT_STEPS=N            optimizer steps (default 3)
  PT_PERTURB=R:K:FQN    on rank R, before optimizer step K, add 1e-3 to FQN's local gradient shard
  PT_NO_GRAD=K:I        at step K, block I does not use its ``gate`` parameter (it gets no gradient)
  PT_KILL=R:K           rank R SIGKILLs itself right after optimizer step K
  PT_DUMP=PATH          write, per rank (PATH with {rank}), what FSDP2 passed to its copy-in ops:
                        the all-gather split sizes and the reduce-scatter gradient shapes, seen
                        by replacing torch.ops.fsdp.all_gather_copy_in / chunk_cat (2.15:
                        chunk_cat_mixed_dtype; independent of parity's capture, which wraps
                        other functions)
  PT_ACCUM=N            backward passes per optimizer step (default 1)
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from tiny_lm import MLPBlock, TinyLM, gloo_mesh

VOCAB = 13
DIM = 8


class Model(TinyLM):
    def __init__(self):
        super().__init__(VOCAB, DIM, lambda: [MLPBlock(DIM, gate=True) for _ in range(2)])


def _pair(name):
    v = os.environ.get(name)
    if not v:
        return None
    a, b = v.split(":", 1)
    return int(a), b


class Dump:
    """Records FSDP2's copy-in calls (the real split sizes) without parity."""

    def __init__(self, path, rank):
        self.path = path.format(rank=rank)
        self.events = []
        self.step = 1
        ns = torch.ops.fsdp
        ag, cc = ns.all_gather_copy_in, ns.chunk_cat

        def all_gather_copy_in(inputs, output, split_sizes, numel, rank_):
            self.events.append({"step": self.step, "kind": "all_gather",
                                "split_sizes": list(split_sizes),
                                "dtypes": [str(t.dtype) for t in inputs],
                                "out_dtype": str(output.dtype)})
            return ag(inputs, output, split_sizes, numel, rank_)

        def recording(op):
            def chunk_cat(tensors, dim, num_chunks, out):
                self.events.append({"step": self.step, "kind": "reduce_scatter",
                                    "shapes": [list(t.shape) for t in tensors],
                                    "dtypes": [str(t.dtype) for t in tensors],
                                    "out_dtype": str(out.dtype), "num_chunks": num_chunks})
                return op(tensors, dim=dim, num_chunks=num_chunks, out=out)
            return chunk_cat

        ns.all_gather_copy_in = all_gather_copy_in
        ns.chunk_cat = recording(cc)
        # torch 2.15 copies the reduce-scatter input in with chunk_cat_mixed_dtype (the same
        # arguments; chunk_cat is left unused there)
        if hasattr(ns, "chunk_cat_mixed_dtype"):
            ns.chunk_cat_mixed_dtype = recording(ns.chunk_cat_mixed_dtype)

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.events, f)
        os.replace(tmp, self.path)


def main():
    rank, _, mesh = gloo_mesh()
    steps = int(os.environ.get("PT_STEPS", "3"))
    accum = int(os.environ.get("PT_ACCUM", "1"))
    perturb = None
    if os.environ.get("PT_PERTURB"):
        p_rank, p_step, p_fqn = os.environ["PT_PERTURB"].split(":", 2)
        perturb = (int(p_rank), int(p_step), p_fqn)
    no_grad = _pair("PT_NO_GRAD")
    kill = _pair("PT_KILL")
    dump = Dump(os.environ["PT_DUMP"], rank) if os.environ.get("PT_DUMP") else None

    torch.manual_seed(0)
    model = Model()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, steps + 1):
        if dump is not None:
            dump.step = step
        for i, block in enumerate(model.layers):
            skip = no_grad is not None and no_grad[0] == step and int(no_grad[1]) == i
            block.use_gate = not skip
        for _ in range(accum):
            tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
        if perturb is not None and perturb[0] == rank and perturb[1] == step:
            grad = dict(model.named_parameters())[perturb[2]].grad
            with torch.no_grad():
                grad.to_local().add_(1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dump is not None:
            dump.write()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if kill is not None and kill[0] == rank and int(kill[1]) == step:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
