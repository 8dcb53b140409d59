"""Small single-rank trainers for the verdict tests (issue 13). Imports nothing from parity.

    python tests/trainers/verdict_cases.py

Knobs (environment):
  VC_CASE=late|bn|lbfgs  late: a second Linear joins the optimizer (add_param_group) at step 3;
                         bn: a BatchNorm model (running statistics are buffers);
                         lbfgs: LBFGS stepped with a closure
  VC_PERTURB=1           late: the joining weight is nudged; bn: another BatchNorm momentum
                         (buffers differ, parameters do not); lbfgs: step 2's loss is scaled
  VC_STEPS=N             optimizer steps (default 4)
  VC_EXIT=N              sys.exit(N) after training
  VC_CRASH_FIRST=K       on torchelastic attempt 0, raise after K steps (a restart test)
  VC_NUDGE_STEP=K        after optimizer step K, nudge one weight (an optimizer-side change)
"""

import os
import sys

import torch
import torch.nn as nn


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    case = os.environ.get("VC_CASE", "late")
    perturb = os.environ.get("VC_PERTURB") == "1"
    steps = int(os.environ.get("VC_STEPS", "4"))
    crash = int(os.environ.get("VC_CRASH_FIRST", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    x = torch.randn(16, 4)
    y = torch.randn(16, 3)

    if case == "bn":
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=0.2 if perturb else 0.1),
                              nn.Linear(8, 3))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    extra = nn.Linear(3, 3)
    if case == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    for step in range(1, steps + 1):
        if case == "late" and step == 3:
            if perturb:
                with torch.no_grad():
                    extra.weight[0, 0] += 1e-3
            opt.add_param_group({"params": list(extra.parameters())})
        if case == "lbfgs":
            def closure():
                opt.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                if perturb and step == 2:
                    loss = loss * 1.001
                loss.backward()
                return loss

            opt.step(closure)
        else:
            opt.zero_grad()
            out = model(x)
            if case == "late" and step >= 3:
                out = extra(out)
            loss = ((out - y) ** 2).mean()
            loss.backward()
            opt.step()
        if step == int(os.environ.get("VC_NUDGE_STEP", "0")):
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
        if crash and attempt == 0 and step == crash:
            raise RuntimeError("planted crash on the first attempt")
    print("done", flush=True)
    code = int(os.environ.get("VC_EXIT", "0"))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
