"""A trainer that traces its model while it trains (torch.export, dynamo's export capture, a
compiled model), printing every graph and compile count. It imports nothing from parity.

    python tests/trainers/traced_model.py

Run with and without `parity exec`, the output must be the same: capture may not change what a
tracer sees (no global module hook: dynamo's export capture cannot trace one, and a compiled
model recompiles when one goes away). The order covers both moments capture could interfere:
before the first module call and optimizer step (AutoParallel traces its model there), and after
capture has built its tables.

Knobs (environment): TM_STEPS (compiled steps, default 3).
"""

import os

import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.norm(self.l1(x))))


def exported(model, x, when):
    ep = torch.export.export(model, (x,))
    print(f"--- torch.export ({when})")
    print(ep.graph_module.code.strip())


def dynamo_exported(model, x, when):
    from torch._dynamo.functional_export import _dynamo_graph_capture_for_export

    gm = _dynamo_graph_capture_for_export(model)(x)  # what AutoParallel traces its model with
    print(f"--- _dynamo_graph_capture_for_export ({when})")
    print(gm.code.strip())


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    x = torch.randn(4, 8)
    dynamo_exported(model, x, "before any module call")
    exported(model, x, "before any module call")

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).square().mean()  # one eager step: capture builds its table here
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"eager step loss {loss.item():.6f}")

    calls = []

    def backend(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    for step in range(int(os.environ.get("TM_STEPS", "3"))):
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"compiled step {step + 1} loss {loss.item():.6f}")
    dynamo_exported(model, x, "after training")
    exported(model, x, "after training")
    stats = torch._dynamo.utils.counters["stats"]
    print(f"compiles {len(calls)} graph sizes {calls} unique_graphs {stats['unique_graphs']}")
    print(f"global forward pre-hooks {len(torch.nn.modules.module._global_forward_pre_hooks)}")


if __name__ == "__main__":
    main()
