"""SimpleFSDP-style data parallelism for the compiled side of the workload.

Every parameter is replaced by a ``DTensor`` sharded with ``Shard(0)`` on the
data-parallel mesh. Reading ``module.<name>`` goes through a class-level
property that all-gathers the shard (``redistribute`` to ``Replicate``) and
returns a plain local tensor whose gradient is declared ``Partial("avg")``, so
autograd turns it into a reduce-scatter with the same average FSDP2 uses on
gloo. Under ``torch.compile`` both collectives show up in the traced graph as
``_c10d_functional.all_gather_into_tensor`` / ``reduce_scatter_tensor``, one
per parameter, which is what the bucketing passes then merge.

This follows torchtitan's ``experiments/simple_fsdp``: a property instead of
``torch.nn.utils.parametrize`` keeps ``named_parameters()`` and ``state_dict()``
keys identical to the eager FSDP2 model (no ``parametrizations.X.original``).
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor, DTensor, Partial, Replicate, Shard


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


class ReplicateComputation(nn.Module):
    """All-gather a ``Shard(0)`` DTensor parameter for compute.

    ``forward_dtype`` casts the local shard before the all-gather (FSDP2 casts
    the sharded parameter to ``param_dtype`` before its all-gather too);
    ``backward_dtype`` casts the gradient before the reduce-scatter, like
    FSDP2's ``reduce_dtype``.
    """

    def __init__(self, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
        super().__init__()
        self.mesh = mesh
        self.param_dtype = mp_policy.param_dtype
        self.reduce_dtype = mp_policy.reduce_dtype
        self.compute_placements = [Replicate()] * mesh.ndim
        self.grad_placements = [Partial("avg")] * mesh.ndim

    def forward(self, x: DTensor) -> torch.Tensor:
        replicated = x.redistribute(
            placements=self.compute_placements,
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        return replicated.to_local(grad_placements=self.grad_placements)


def _register_parametrization(
    module: nn.Module, param_names: list[str], parametrization: nn.Module
) -> None:
    """Swap ``module.__class__`` for a subclass whose ``param_names`` are properties.

    ``nn.Module.__getattr__`` is only reached when normal attribute lookup
    fails, so a class property shadows ``_parameters[name]`` for attribute
    reads while ``named_parameters()`` / ``state_dict()`` still see the raw
    DTensor parameter under its original name.
    """
    properties = {
        name: property(lambda self, pn=name: parametrization(self._parameters[pn]))
        for name in param_names
    }
    cls = module.__class__
    module.__class__ = type(f"SimpleFSDP{cls.__name__}", (cls,), properties)


def data_parallel(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """Shard every parameter of ``model`` with ``Shard(0)`` in place and return it.

    All ranks must hold the same full parameters on entry (seed before
    construction); the local shard of rank r is then the r-th ``torch.chunk``
    of dim 0, the same values FSDP2's ``fully_shard`` keeps when dim 0 is
    divisible by the world size.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    for module in list(model.modules()):
        if module.__class__.__name__.startswith("SimpleFSDP"):
            continue
        param_names = []
        for name, param in list(module.named_parameters(recurse=False)):
            if param.numel() == 0:
                continue
            if param.shape[0] % mesh.size() != 0:
                raise ValueError(
                    f"parameter {name} of {module.__class__.__name__} has dim 0 "
                    f"{param.shape[0]}, not divisible by the world size {mesh.size()}; "
                    "the workload keeps shards unpadded so that they match FSDP2's"
                )
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            param_names.append(name)
        if param_names:
            _register_parametrization(module, param_names, ReplicateComputation(mesh, mp_policy))
    return model
