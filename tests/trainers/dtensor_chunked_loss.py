"""A 1-rank DTensor job whose loss wrapper calls an lm_head-like module per chunk and runs
backward per chunk (torchtitan's chunked loss, eager): each chunk all-gathers a bool mask of
the weight and the weight (Shard -> Replicate) and reduce-scatters its gradient (Partial ->
Shard). Captured through the
API (``parity.capture.start``) by tests/test_capture_eager_collectives.py, which passes the out
dir as argv[1]."""
import os, socket, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate, Partial
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
out = sys.argv[1]
import parity.capture  # noqa: E402 - the capture API, as a user would call it

session = parity.capture.start(out)
mesh = init_device_mesh("cpu", (1,))

class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)]))
    def forward(self, x):
        # a mask of the weight's shape, all-gathered under the same module (as torch 2.15's
        # torchtitan does): no cast of the weight, not named after it
        (self.weight.detach() != 0).redistribute(placements=[Replicate()])
        w = self.weight.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        return x @ w.t()

class ChunkLoss:
    def __init__(self, head): self.head = head
    def __call__(self, x):
        total = 0.0
        for c in x.chunk(2):
            l = self.head(c).sum(); l.backward(); total += l.detach()
        return total

class Trainer:
    def __init__(self):
        self.model = torch.nn.Sequential(Head())
        self.loss_fn = ChunkLoss(self.model[0])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
    def step(self):
        self.loss_fn(torch.ones(4, 3)); self.opt.step(); self.opt.zero_grad()

t = Trainer()
for _ in range(2): t.step()
session.stop()
dist.destroy_process_group()
