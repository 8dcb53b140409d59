"""A plain single-process trainer used by the capture tests. It imports nothing from parity.

    python tests/trainers/plain_single.py

Knobs (environment):
  PT_STEPS=N         optimizer steps (default 3)
  PT_OPT=plain|container|siblings
                     one AdamW; an Optimizer subclass that steps two inner optimizers (nested
                     step hooks); or two optimizers stepped one after the other
  PT_COMPILE=module|fn
                     torch.compile(model) or a fullgraph torch.compile'd function calling it (the
                     first module call is then traced by dynamo); a counting backend prints
                     "compiles N" at the end
  PT_CHILD=1         start a Python child process after step 1 (it must not capture)
  PT_PARAMETRIZE=1   the last layer's weight goes through torch.nn.utils.parametrize
"""

import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Container(torch.optim.Optimizer):
    """Steps inner optimizers from its own step (like torchtitan's OptimizersContainer)."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class Scale(nn.Module):
    def forward(self, w):
        return w * 1.0


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps = int(os.environ.get("PT_STEPS", "3"))
    kind = os.environ.get("PT_OPT", "plain")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    if os.environ.get("PT_PARAMETRIZE") == "1":
        import torch.nn.utils.parametrize as P

        P.register_parametrization(model[2], "weight", Scale())
    step_model = model
    compiles = [0]

    def backend(gm, inputs):
        compiles[0] += 1
        return gm.forward

    if os.environ.get("PT_COMPILE") == "module":
        step_model = torch.compile(model, backend=backend)
    elif os.environ.get("PT_COMPILE") == "fn":
        step_model = torch.compile(lambda x: model(x), fullgraph=True, backend=backend)
    if kind == "plain":
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    else:
        inner = [torch.optim.AdamW(model[0].parameters(), lr=1e-2),
                 torch.optim.SGD(model[2].parameters(), lr=1e-2)]
        opts = [Container(inner)] if kind == "container" else inner
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(5, 4, generator=gen)
        y = torch.randint(0, 3, (5,), generator=gen)
        loss = F.cross_entropy(step_model(x), y)
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        if step == 1 and os.environ.get("PT_CHILD") == "1":
            code = "import os, torch; print('child', os.environ.get('PARITY_CAPTURE_ACTIVE'))"
            subprocess.run([sys.executable, "-c", code], check=True)
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    if os.environ.get("PT_COMPILE"):
        print(f"compiles {compiles[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
