"""Differences between two runs in the facts that change numerics on a GPU.

Why a separate check: a bitwise difference between two runs on different GPU models, drivers,
CUDA/cuDNN/NCCL builds or TF32/cuDNN settings is expected, not a bug; the diff still compares
the hashes, and these lines (reported as warnings, ``problems`` with no side) tell the reader why
a mismatch may be the environment's. Reads ``meta.json`` ``gpu`` (parity/capture/gpu_facts.py)
and ``device``; runs recorded before ``gpu`` existed are not compared here.
"""

from __future__ import annotations

__all__ = ["numerics_env_differences", "numerics_differences"]

_LABELS = {
    "name": "GPU", "capability": "compute capability", "driver": "NVIDIA driver",
    "driver_cuda": "driver CUDA version", "cuda": "CUDA", "hip": "HIP", "cudnn": "cuDNN",
    "nccl": "NCCL", "matmul_allow_tf32": "TF32 matmul (torch.backends.cuda.matmul.allow_tf32)",
    "cudnn_allow_tf32": "TF32 cuDNN (torch.backends.cudnn.allow_tf32)",
    "float32_matmul_precision": "float32 matmul precision", "cudnn_enabled": "cuDNN enabled",
    "cudnn_deterministic": "cudnn.deterministic", "cudnn_benchmark": "cudnn.benchmark",
    "CUBLAS_WORKSPACE_CONFIG": "CUBLAS_WORKSPACE_CONFIG",
}


def _device_type(meta: dict) -> str | None:
    dev = meta.get("device")
    return dev.split(":")[0] if isinstance(dev, str) else None


def numerics_env_differences(meta_a: dict | None, meta_b: dict | None) -> list[str]:
    """One line per GPU fact that differs between two ranks' ``meta.json`` (A's and B's)."""
    if not meta_a or not meta_b:
        return []
    ta, tb = _device_type(meta_a), _device_type(meta_b)
    if ta and tb and ta != tb:
        return [f"the runs used different devices (A {ta}, B {tb}): bitwise equality is not "
                "expected across device types"]
    out = numerics_differences(meta_a.get("numerics"), meta_b.get("numerics"))
    ga, gb = meta_a.get("gpu"), meta_b.get("gpu")
    if not isinstance(ga, dict) or not isinstance(gb, dict):
        return out
    for key in sorted(set(ga) | set(gb), key=lambda k: (k not in _LABELS, list(_LABELS).index(k)
                                                        if k in _LABELS else 0, k)):
        va, vb = ga.get(key), gb.get(key)
        if va != vb:
            out.append(f"{_LABELS.get(key, key)} differs (A {va!r}, B {vb!r}): "
                       "this can change results bitwise")
    return out


_NUMERICS_LABELS = {
    "nccl_version": "NCCL version", "backend": "process group backend",
    "deterministic_algorithms": "torch.are_deterministic_algorithms_enabled()",
    "cuda_graphs": "CUDA graphs",
}
_CAUSE = "a possible cause of a bitwise difference"


def numerics_differences(na, nb) -> list[str]:
    """One line per fact of ``meta.json`` ``numerics`` (parity/capture/fingerprint.py) that
    differs between A and B, each named as a possible cause. The NCCL environment is compared
    variable by variable (unset is ``None``); inductor's settings only when both sides used
    inductor (an eager side has none, and that is no difference in settings); a fact one side
    did not record (``None``, an older parity) is not compared."""
    if not isinstance(na, dict) or not isinstance(nb, dict):
        return []
    out = []
    ea, eb = na.get("nccl_env"), nb.get("nccl_env")
    if isinstance(ea, dict) and isinstance(eb, dict):
        for k in sorted(set(ea) | set(eb)):
            if ea.get(k) != eb.get(k):
                out.append(f"{k} differs (A {ea.get(k)!r}, B {eb.get(k)!r}): {_CAUSE}")
    for k, label in _NUMERICS_LABELS.items():
        va, vb = na.get(k), nb.get(k)
        if va is not None and vb is not None and va != vb:
            out.append(f"{label} differs (A {va!r}, B {vb!r}): {_CAUSE}")
    ia, ib = na.get("inductor"), nb.get("inductor")
    if isinstance(ia, dict) and isinstance(ib, dict):
        for k in sorted(set(ia) & set(ib)):
            if ia[k] != ib[k]:
                out.append(f"inductor config {k} differs (A {ia[k]!r}, B {ib[k]!r}): {_CAUSE}")
    return out
