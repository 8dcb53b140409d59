"""A tiny trainer whose optimizer state is the only thing two runs may differ in (imports
nothing from parity). Knobs (environment):

  OS_OPT=adam|sgd   the optimizer (default adam)
  OS_B1=0.5         Adam's beta1: 0.5 and 0.75 give bitwise the same first step (the moment
                    (1 - beta1) g is divided by the same (1 - beta1)), other exp_avg
  OS_MOM=0          SGD's momentum: 0 keeps no state, any other value a momentum_buffer equal to
                    the gradient after the first step (the same update)
  OS_STEPS=1        optimizer steps
  OS_SAVE=path      torch.save of the model's and the optimizer's state dicts at the end
  OS_RELOAD=1       after step 1, load a deep copy of the optimizer's state taken then, and
                    print whether the state it replaced was freed ("replaced state freed: True")

    python tests/trainers/opt_state.py
    torchrun --standalone --nproc_per_node 2 tests/trainers/opt_state.py   (OS_FSDP=1: FSDP2)
"""

import os

import torch
import torch.nn as nn

OPT = os.environ.get("OS_OPT", "adam")
B1 = float(os.environ.get("OS_B1", "0.5"))
MOM = float(os.environ.get("OS_MOM", "0"))
STEPS = int(os.environ.get("OS_STEPS", "1"))
FSDP = os.environ.get("OS_FSDP") == "1"
RELOAD = os.environ.get("OS_RELOAD") == "1"


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if FSDP:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
    if OPT == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(B1, 0.999))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=MOM)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for i in range(STEPS):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if RELOAD and i == 0:
            import copy
            import gc
            import weakref

            saved = copy.deepcopy(opt.state_dict())
            replaced = [weakref.ref(t) for st in opt.state.values() for t in st.values()
                        if isinstance(t, torch.Tensor)]
            opt.load_state_dict(saved)
            del saved
            gc.collect()
            print(f"replaced state freed: {all(r() is None for r in replaced)}", flush=True)
    if os.environ.get("OS_SAVE"):
        torch.save({"model": {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                              for k, v in model.state_dict().items()},
                    "opt": opt.state_dict()}, os.environ["OS_SAVE"])
    if FSDP:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
