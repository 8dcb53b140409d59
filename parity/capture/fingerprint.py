"""The numerics fingerprint, for ``meta.json`` ``numerics`` (docs/artifacts.md).

Why: beyond the GPU facts (gpu_facts.py), a handful of switches change results bitwise without
changing the program: NCCL's algorithm, protocol and channel counts change the reduction order of
a collective; deterministic algorithms and inductor's precision, autotuning and RNG settings
change kernels; CUDA graphs change what is replayed. Engineers chasing a divergence pin these by
hand (``NCCL_ALGO=Ring NCCL_PROTO=Simple``); recording them lets ``parity diff`` name every one
that differs between two runs as a possible cause (parity/diff/env.py).

Zero-modification rule: everything is read from what the process already has. Inductor's config
is read only if inductor compiled a graph in this process by the first step (``sys.modules``);
otherwise ``inductor`` is None and nothing is imported. The NCCL version is asked only when
CUDA is already initialized in this process. Called once, after the trainer's first step. A fact
that cannot be read is None.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["collect", "NCCL_ENV", "INDUCTOR_KEYS"]

# the NCCL environment that changes the reduction order (always recorded, None when unset)
NCCL_ENV = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
            "NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "NCCL_NVLS_ENABLE", "NCCL_NTHREADS",
            "NCCL_BUFFSIZE", "NCCL_LL128_ENABLE", "NCCL_TREE_THRESHOLD", "NCCL_CUMEM_ENABLE")
# other NCCL_* variables are recorded too, except these (logging and transport selection)
_NCCL_IGNORED_PREFIXES = ("NCCL_DEBUG", "NCCL_SOCKET_", "NCCL_IB_", "NCCL_ASYNC_",
                          "NCCL_COMM_ID", "NCCL_HOSTID", "NCCL_UID_")

# inductor settings that change rounding or the order of arithmetic (torch/_inductor/config.py)
INDUCTOR_KEYS = (
    "emulate_precision_casts", "fallback_random", "max_autotune", "max_autotune_gemm",
    "max_autotune_pointwise", "max_autotune_gemm_backends", "coordinate_descent_tuning",
    "deterministic", "split_reductions", "online_softmax", "use_fast_math", "use_mixed_mm",
    "freezing", "layout_optimization", "force_layout_optimization", "epilogue_fusion",
    "aggressive_fusion", "pattern_matcher", "unroll_reductions_threshold",
    "reorder_for_compute_comm_overlap", "bucket_all_gathers_fx", "bucket_reduce_scatters_fx",
    "cpp_wrapper", "benchmark_kernel",
    "triton.cudagraphs", "triton.cudagraph_trees", "triton.codegen_upcast_to_fp32",
    "triton.persistent_reductions", "triton.cooperative_reductions",
    "triton.force_cooperative_reductions", "triton.multi_kernel", "triton.prefer_nd_tiling",
    "triton.mix_order_reduction", "triton.use_fast_math",
    "cpp.simdlen", "cpp.enable_floating_point_contract_flag", "cpp.dynamic_threads",
)


def _plain(v):
    """A JSON-safe form of a config value (enums, lists, odd objects become strings)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return str(v)


def _inductor() -> dict | None:
    """Inductor's settings, if inductor lowered a graph in this process (``torch._inductor.graph``
    is imported then; ``torch._dynamo`` alone imports the config, eager jobs included)."""
    cfg = sys.modules.get("torch._inductor.config")
    if cfg is None or "torch._inductor.graph" not in sys.modules:
        return None
    out = {}
    for key in INDUCTOR_KEYS:
        obj, ok = cfg, True
        for part in key.split("."):
            try:
                obj = getattr(obj, part)
            except Exception:  # noqa: BLE001 - a setting this torch lacks: not recorded
                ok = False
                break
        if ok:
            out[key] = _plain(obj)
    return out


def _nccl_env() -> dict:
    env = {k: os.environ.get(k) for k in NCCL_ENV}
    for k, v in sorted(os.environ.items()):
        if k.startswith("NCCL_") and k not in env and not k.startswith(_NCCL_IGNORED_PREFIXES):
            env[k] = v
    return env


def _nccl_version() -> str | None:
    """NCCL's version, asked only where CUDA is already initialized (never initializes it)."""
    try:
        if not torch.cuda.is_initialized():
            return None
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - not built with NCCL
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _backend() -> str | None:
    try:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return str(dist.get_backend())
    except Exception:  # noqa: BLE001
        pass
    return None


def _cuda_graphs(inductor: dict | None) -> bool | None:
    """CUDA graphs on/off where it can be told: inductor's ``triton.cudagraphs`` when inductor
    is in use, True when cudagraph trees (inductor's or a trainer's ``torch.cuda.graphs``
    replays) were imported and a graph pool exists; None when nothing says."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        trees = sys.modules.get("torch._inductor.cudagraph_trees")
        try:
            if trees is not None and getattr(trees, "local", None) is not None and any(
                    getattr(trees.local, "tree_manager_containers", {}) or {}):
                return True
        except Exception:  # noqa: BLE001
            pass
    if inductor is not None and isinstance(inductor.get("triton.cudagraphs"), bool):
        return inductor["triton.cudagraphs"]
    return None


def collect() -> dict:
    """The fingerprint of this process now (after the trainer's first step)."""
    inductor = _inductor()
    try:
        det = bool(torch.are_deterministic_algorithms_enabled())
    except Exception:  # noqa: BLE001
        det = None
    return {
        "nccl_env": _nccl_env(),
        "nccl_version": _nccl_version(),
        "backend": _backend(),
        "deterministic_algorithms": det,
        "inductor": inductor,
        "cuda_graphs": _cuda_graphs(inductor),
    }
