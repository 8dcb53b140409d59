"""The numerics fingerprint, for ``meta.json`` ``numerics`` (docs/artifacts.md).

Why: beyond the GPU facts (gpu_facts.py), a handful of switches change results bitwise without
changing the program: NCCL's algorithm, protocol and channel counts change the reduction order of
a collective; deterministic algorithms and inductor's precision, autotuning and RNG settings
change kernels; CUDA graphs change what is replayed. Engineers chasing a divergence pin these by
hand (``NCCL_ALGO=Ring NCCL_PROTO=Simple``); recording them lets ``parity diff`` name every one
that differs between two runs as a possible cause (parity/diff/env.py).

Zero-modification rule: everything is read from what the process already has. Inductor's config
is read only if inductor compiled a graph in this process by the first step (``sys.modules``);
otherwise ``inductor`` is None and nothing is imported. Inductor's settings are those each
compiled region was compiled with (its mode preset and options: see "compiled regions" below),
refreshed when the run ends. The NCCL version is asked only when
CUDA is already initialized in this process. Called once, after the trainer's first step. A fact
that cannot be read is None.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

__all__ = ["collect", "refresh", "install_compile_hook", "regions", "NCCL_ENV", "INDUCTOR_KEYS"]

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


def _settings(cfg, patch: dict | None = None) -> dict:
    """INDUCTOR_KEYS as inductor applies them: ``patch`` (a compile's own options) over the
    global config ``cfg``. A key this torch lacks is left out."""
    out = {}
    for key in INDUCTOR_KEYS:
        if patch and key in patch:
            out[key] = _plain(patch[key])
            continue
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


def _inductor() -> dict | None:
    """Inductor's settings, if inductor lowered a graph in this process (``torch._inductor.graph``
    is imported then; ``torch._dynamo`` alone imports the config, eager jobs included): those
    of the compiled regions themselves when any was seen (:func:`install_compile_hook`; a key
    on which the regions disagree holds their values in compile order), else the global
    config (a backend that calls ``compile_fx`` without options compiles with it)."""
    cfg = sys.modules.get("torch._inductor.config")
    if cfg is None or ("torch._inductor.graph" not in sys.modules and not _REGIONS):
        return None
    if not _REGIONS:
        return _settings(cfg)
    out: dict = {}
    for key in INDUCTOR_KEYS:
        vals: list = []
        for r in _REGIONS:
            if key in r["inductor"] and r["inductor"][key] not in vals:
                vals.append(r["inductor"][key])
        if vals:
            out[key] = vals[0] if len(vals) == 1 else vals
    return out


# ------------------------------------------------------------------------- compiled regions
# ``torch.compile(model, mode="max-autotune-no-cudagraphs")`` (or ``options={...}``) does not
# change the global inductor config: the mode preset and the options become a per-compile patch
# (``_TorchCompileInductorWrapper.config``, torch/__init__.py), which ``compile_fx`` applies with
# ``config.patch(config_patches)`` around the compilation and again around ``inner_compile``
# for the backward compiled later (torch/_inductor/compile_fx.py, ``compile_fx``; torch 2.13).
# Reading the global config after the fact says ``max_autotune: false``. So each call of the
# wrapper (one per graph dynamo hands to inductor) is noted with its patch and the settings it
# gives: a pass-through that reads a dict, never inside a trace, changing no guard, cache key or
# config (no recompile).
_REGIONS: list[dict] = []  # one per distinct patch: compile ids, the patch, the settings
_MAX_IDS = 8


def _note_region(wrapper, extra) -> None:
    patch = {**(getattr(wrapper, "config", None) or {}), **(extra or {})}
    from torch._inductor import config as cfg  # what the wrapper imports next (compile_fx)
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        cid = None if cid is None else str(cid)
    except Exception:  # noqa: BLE001
        cid = None
    plain = {str(k): _plain(v) for k, v in sorted(patch.items())}
    for r in _REGIONS:
        if r["patch"] == plain:
            if cid is not None and cid not in r["compile_ids"] and len(r["compile_ids"]) < _MAX_IDS:
                r["compile_ids"].append(cid)
            r["graphs"] += 1
            return
    _REGIONS.append({"compile_ids": [] if cid is None else [cid], "graphs": 1,
                     "name": getattr(wrapper, "name", None), "patch": plain,
                     "inductor": _settings(cfg, patch)})


def install_compile_hook() -> bool:
    """Note every inductor compilation's own options (``_TorchCompileInductorWrapper.__call__``,
    a class attribute looked up at each call, wrapped once per process); False when this torch
    has no such wrapper."""
    cls = getattr(torch, "_TorchCompileInductorWrapper", None)
    orig = getattr(cls, "__call__", None)
    if orig is None:
        return False
    if getattr(orig, "_parity_wrapped", False):
        return True

    @functools.wraps(orig)
    def __call__(self, model_, inputs_, *args, **kwargs):
        try:
            _note_region(self, kwargs.get("config_patches"))
        except Exception:  # noqa: BLE001 - never get in the way of compilation
            pass
        return orig(self, model_, inputs_, *args, **kwargs)

    __call__._parity_wrapped = True  # type: ignore[attr-defined]
    cls.__call__ = __call__
    return True


def regions() -> list[dict]:
    """The compiled regions noted so far (meta.json ``numerics.inductor_regions``)."""
    return [{k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
             for k, v in r.items() if k != "inductor"} for r in _REGIONS]


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
        "inductor_regions": regions(),
        "cuda_graphs": _cuda_graphs(inductor),
    }


def refresh(numerics) -> dict | None:
    """``numerics`` (as collected at the first step) with the inductor facts of the regions
    compiled since (a later recompile, a model compiled after step 1); the rest unchanged (at
    the end of a run the process group may be gone)."""
    if not isinstance(numerics, dict):
        return numerics
    inductor = _inductor()
    if inductor is None:
        return numerics
    return {**numerics, "inductor": inductor, "inductor_regions": regions(),
            "cuda_graphs": _cuda_graphs(inductor)}
