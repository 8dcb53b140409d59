"""Run ``torchtitan.train`` unmodified on CPU/gloo: ``torchrun ... launch.py [torchtitan args]``.

Import-time shims only (each one says what fails on CPU without it); no torchtitan file is
edited and nothing here changes the numerics the two sides of a parity test compare:

* device: torchtitan falls back to "cuda" when no accelerator is found, and its memory monitor
  calls device functions ``torch.cpu`` lacks;
* FlexAttention: CPU backward is refused and inductor's flex backward does not build on CPU; an
  aot_eager-compiled flex works (re-applied after ``set_determinism``, which recompiles it);
* gloo has no ``ReduceOp.PREMUL_SUM`` (FSDP2 with ``gradient_divide_factor=1.0``): FSDP2's
  ``force_sum_reduction_for_comms`` issues a plain SUM, the same numbers;
* after step 1 torchtitan shortens process-group timeouts with a CUDA-style barrier and
  ``torch.distributed.set_timeout`` (absent in torch 2.13): skipped;
* inductor's overlap scheduler asks triton for GPU DRAM bandwidth and benchmarks on the GPU.
"""

from __future__ import annotations

import runpy
import sys
import types

import torch
import torch._utils


def _shim_device() -> None:
    orig = torch._utils._get_available_device_type

    def available_device_type():
        return orig() or "cpu"

    torch._utils._get_available_device_type = available_device_type
    cpu = torch.cpu
    props = types.SimpleNamespace(name="cpu", total_memory=24 * 2**30, major=0, minor=0)
    defaults = {
        "get_device_name": lambda *a, **k: "cpu",
        "get_device_properties": lambda *a, **k: props,
        "memory_stats": lambda *a, **k: {},
        "reset_peak_memory_stats": lambda *a, **k: None,
        "empty_cache": lambda *a, **k: None,
    }
    for name, fn in defaults.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)


def _shim_flex() -> None:
    import torch.nn.attention.flex_attention as fa

    orig_validate = fa._validate_device

    def validate_device(query, key, value):
        if query.device.type == "cpu":
            return None
        return orig_validate(query, key, value)

    fa._validate_device = validate_device

    from torchtitan.models.common.attention import FlexAttention

    # One compiled object, reused: a second torch.compile of flex_attention with another
    # backend callable makes dynamo recompile (BACKEND_MATCH guard).
    compiled = torch.compile(fa.flex_attention, backend="aot_eager")

    def cpu_flex():
        FlexAttention._compiled_flex_attn = compiled

    cpu_flex()
    import torchtitan.distributed.utils as dist_utils

    orig_set_determinism = dist_utils.set_determinism

    def set_determinism(*args, **kwargs):
        out = orig_set_determinism(*args, **kwargs)
        cpu_flex()
        return out

    dist_utils.set_determinism = set_determinism
    # After step 1 torchtitan shortens the process-group timeouts: a barrier with
    # device_ids=[torch.cpu.current_device()] ("cpu", refused by gloo) and
    # torch.distributed.set_timeout (absent in 2.13). Timeouts only: skipped on CPU.
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None


def _shim_gloo() -> None:
    from torch.distributed.fsdp import FSDPModule

    orig = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor):
        orig(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _shim_inductor() -> None:
    import importlib

    for name in ("torch._inductor.utils", "torch._inductor.scheduler",
                 "torch._inductor.fx_passes.pad_mm", "torch.utils._runtime_estimation"):
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001
            continue
        if hasattr(mod, "get_gpu_dram_gbps"):
            mod.get_gpu_dram_gbps = lambda: 100
    try:
        import torch._inductor.config as ic

        ado = getattr(ic, "aten_distributed_optimizations", None)
        if ado is not None and hasattr(ado, "compute_estimator"):
            ado.compute_estimator = "analytical"
    except Exception:  # noqa: BLE001
        pass


def main() -> None:
    _shim_device()
    _shim_gloo()
    _shim_inductor()
    _shim_flex()
    sys.argv = ["torchtitan.train", *sys.argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
