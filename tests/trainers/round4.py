"""Trainers of issue 32 (verdicts that cannot be fooled, round 4). Imports nothing from parity.

    python tests/trainers/round4.py                         (plain, one process)
    torchrun --standalone --nproc_per_node 2 tests/trainers/round4.py   (R4_CASE=reduce|mixed)

Knobs (environment):
  R4_CASE=plain|scaler|compile|twoopt|reduce|mixed   (default plain)
      plain    two Linear layers (four parameters), SGD, R4_STEPS steps
      scaler   the same with torch.amp.GradScaler("cpu", init_scale=R4_SCALE): the trainer calls
               backward() on scaler.scale(loss) and steps through scaler.step(opt)
      compile  the same model under torch.compile(mode=R4_MODE) (default: no mode)
      twoopt   one optimizer per layer, stepped back to back after one backward (one step)
      reduce   torchrun: dist.reduce of a float tensor before training (--emulate-nccl refuses it)
      mixed    torchrun: init_process_group("cpu:gloo,cuda:nccl") (--emulate-nccl refuses it)
  --fail-if PATH      (argument) exit 3 before training while PATH exists (a sweep's failing side)
  R4_STEPS=N          optimizer steps (default 3)
  R4_CLAMP=C          after step R4_CLAMP_AFTER's step() (default: the last), clamp every
                      parameter to [-C, C] in place (C=10 leaves this model unchanged)
  R4_SCALE=S          (scaler) GradScaler init_scale (default 65536)
  R4_INF_AT=K         (scaler) step K's gradients get an inf before scaler.step: the scaler skips
  R4_MODE=M           (compile) torch.compile mode, e.g. max-autotune-no-cudagraphs
  R4_AFTER=a,b,...    after the last step, in this order: load (load_state_dict(..., assign=True)
                      of shifted weights), replace (l2.weight set to a new nn.Parameter), buffer
                      (register_buffer "calib"), swa (an AveragedModel built and shifted); the
                      model is kept alive to the end of the process
  R4_AFTER_B=name     that edit shifts by another value (0.5 instead of 0.25)
  R4_OSEXIT=1         end with os._exit(0) (no atexit handlers run)
  R4_NPBUF=V          the model holds a non-persistent buffer "mask" of value V that its forward
                      does not read
"""

import os
import sys

import torch
import torch.nn as nn


def env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v else default


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 2)
        npbuf = os.environ.get("R4_NPBUF")
        if npbuf:  # a non-persistent buffer the forward does not read (not in state_dict)
            self.register_buffer("mask", torch.full((8,), float(npbuf)), persistent=False)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def train():
    case = os.environ.get("R4_CASE", "plain")
    steps = env_int("R4_STEPS", 3)
    clamp = os.environ.get("R4_CLAMP")
    clamp_after = env_int("R4_CLAMP_AFTER", steps)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    fwd = model
    if case == "compile":
        mode = os.environ.get("R4_MODE") or None
        fwd = torch.compile(model, mode=mode) if mode else torch.compile(model)
    if case == "twoopt":
        opts = [torch.optim.SGD(model.l1.parameters(), lr=0.1),
                torch.optim.SGD(model.l2.parameters(), lr=0.1)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    scaler = None
    if case == "scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=float(os.environ.get("R4_SCALE",
                                                                             "65536")))
    inf_at = env_int("R4_INF_AT", 0)
    for i in range(1, steps + 1):
        for o in opts:
            o.zero_grad()
        x, y = batch(i)
        loss = nn.functional.mse_loss(fwd(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if i == inf_at:
                model.l1.weight.grad[0, 0] = float("inf")
            scaler.step(opts[0])
            scaler.update()
        else:
            loss.backward()
            for o in opts:
                o.step()
        if clamp and i == clamp_after:
            with torch.no_grad():
                for p in model.parameters():
                    p.clamp_(-float(clamp), float(clamp))
        print(f"step {i} loss {loss.item():.6f}", flush=True)
    after_training(model)
    if case == "compile":  # the job compiled once: capture made it recompile nothing
        from torch._dynamo.utils import counters

        print(f"unique graphs {counters['stats']['unique_graphs']}", flush=True)


KEEP = []  # what the trainer holds at exit (a script's module-level model)


def after_training(model):
    """Edits a trainer makes after its last step() (R4_AFTER): what it saves is the result."""
    edits = [x for x in os.environ.get("R4_AFTER", "").split(",") if x]
    other = os.environ.get("R4_AFTER_B", "")

    def shift(name):
        return 0.5 if name == other else 0.25

    KEEP.append(model)
    with torch.no_grad():
        if "load" in edits:  # the best checkpoint, loaded by assignment: new tensors
            state = {k: v.detach().clone() + shift("load") for k, v in model.state_dict().items()}
            model.load_state_dict(state, assign=True)
        if "replace" in edits:  # a merged or folded weight: a new Parameter on the module
            model.l2.weight = nn.Parameter(model.l2.weight.detach() + shift("replace"))
        if "buffer" in edits:  # a calibration buffer registered at the end
            model.register_buffer("calib", torch.full((2,), shift("buffer")))
        if "swa" in edits:  # an averaged copy built after training
            from torch.optim.swa_utils import AveragedModel

            swa = AveragedModel(model)
            for p in swa.parameters():
                p.add_(shift("swa"))
            KEEP.append(swa)


def collective(case):
    import torch.distributed as dist

    dist.init_process_group("cpu:gloo,cuda:nccl" if case == "mixed" else "gloo")
    t = torch.ones(4) * (dist.get_rank() + 1)
    dist.reduce(t, dst=0)
    train()
    dist.destroy_process_group()


def main():
    case = os.environ.get("R4_CASE", "plain")
    if "--fail-if" in sys.argv:  # a sweep's side that fails until the file is gone
        if os.path.exists(sys.argv[sys.argv.index("--fail-if") + 1]):
            print("failing on purpose (--fail-if: the file exists)", file=sys.stderr)
            sys.exit(3)
    if case in ("reduce", "mixed"):
        collective(case)
    else:
        train()
    if os.environ.get("R4_OSEXIT"):  # no atexit handler runs: capture cannot close its records
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
