"""An FSDP2 trainer with gradient accumulation, or with a hand-written update. It imports
nothing from parity.

    torchrun --standalone --nproc_per_node 2 tests/trainers/grad_accum.py

Each step runs GA_MICRO micro-batches (default 2), each ``(loss / GA_MICRO).backward()``, and
prints the step's loss as trainers report it: the sum of the micro-batch shares
(``step N loss X``, rank 0, X as ``repr`` of the float32 sum). The blocks are resharded after
forward, so a backward re-gathers them: the second micro-batch's forward all-gathers come
after the first one's backward all-gathers.

Knobs (environment):
  GA_STEPS=N      optimizer steps (default 2)
  GA_MICRO=N      micro-batches per step (default 2)
  GA_UPDATE=hand  no torch.optim optimizer: ``sgd_update(model, lr)`` in this script updates
                  the parameters by hand (``parity exec --step-on grad_accum:sgd_update``)
  GA_UPDATE=imported  the same update, looked up in the module hand_update.py next to this
                  file (``--step-on hand_update:sgd_update``, or
                  ``trainers.hand_update:sgd_update`` when run as ``-m trainers.grad_accum``)

Also runs as a module: ``torchrun ... -m trainers.grad_accum`` from tests/.
"""

import importlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard


def _sibling(name):
    """A module next to this file, whether it runs as a script or as ``-m trainers.grad_accum``."""
    return importlib.import_module(f"{__package__}.{name}" if __package__ else name)


_tiny_lm = _sibling("tiny_lm")
MLPBlock, TinyLM, gloo_mesh = _tiny_lm.MLPBlock, _tiny_lm.TinyLM, _tiny_lm.gloo_mesh

VOCAB = 13
DIM = 8


class Model(TinyLM):
    def __init__(self):
        super().__init__(VOCAB, DIM, lambda: [MLPBlock(DIM) for _ in range(2)])


# A hand-written SGD step (no torch.optim): what --step-on names, here (grad_accum:sgd_update)
# or in its own module (hand_update:sgd_update).
sgd_update = _sibling("hand_update").sgd_update


def main():
    rank, _, mesh = gloo_mesh()
    steps = int(os.environ.get("GA_STEPS", "2"))
    micro = int(os.environ.get("GA_MICRO", "2"))
    hand = os.environ.get("GA_UPDATE") in ("hand", "imported")
    # looked up now: --step-on wraps the name where the trainer looks it up
    update = _sibling("hand_update").sgd_update if os.environ.get(
        "GA_UPDATE") == "imported" else sgd_update

    torch.manual_seed(0)
    model = Model()
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    opt = None if hand else torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1000 + rank)

    for step in range(1, steps + 1):
        shares = []
        for _ in range(micro):
            tokens = torch.randint(0, VOCAB, (2, 6), generator=gen)
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / micro
            loss.backward()
            shares.append(loss.detach())
        if hand:
            update(model, 1e-2)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        reported = torch.stack(shares).sum()
        print(f"rank {rank} step {step} loss {reported.item()!r} last {shares[-1].item()!r}",
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
