"""The host-time loop of capture's device digest path, shared by benchmarks/run.py (on CUDA:
``cuda_host_ms_per_step``) and benchmarks/host_path_cpu.py (on CPU, device work stubbed out).

Each step runs what capture runs (writing.py, steps.py): the parameters at the step's entry
(a stable list, no figures, the buffer rows left out: here one row in a hundred), the gradients
with their parameters as owners, the parameters after the step (a stable list), both with or
without figures, then the previous step's digests and figures read back."""

from __future__ import annotations

import statistics
import time

import torch

from parity.capture.hashing import digest_tensors_async

PARTS = ("entry", "grads", "params", "read")


def small_tensors(count: int, device: str = "cpu", seed: int = 1) -> list[torch.Tensor]:
    """``count`` parameters of 1-64 KB as a real model's list has them: 256-16,384 elements,
    fp32, one in three bf16."""
    g = torch.Generator(device=device).manual_seed(seed)
    sizes = torch.randint(256, 16384, (count,), generator=g, device=device).tolist()
    return [torch.randn(n, device=device, generator=g,
                        dtype=torch.bfloat16 if i % 3 == 1 else torch.float32)
            for i, n in enumerate(sizes)]


def model_lists(count: int = 1500, device: str = "cpu"):
    """(params, grads, entry): ``count`` small parameters, a gradient for each, and the entry
    list (the parameters with one row in a hundred left out, as capture leaves out buffers)."""
    params = small_tensors(count, device)
    grads = [torch.empty_like(p) for p in params]
    entry = [None if i % 100 == 50 else p for i, p in enumerate(params)]
    return params, grads, entry


def time_steps(params, grads, entry, steps: int, figures: bool = True, before=None,
               warmup: int = 5):
    """Host time of ``steps`` steps after ``warmup``: (median ms per step, {part: median us})
    for the parts in ``PARTS``. ``before`` runs ahead of each step, untimed (a device sync)."""
    total, parts, prev, prev_entry = [], [], None, None
    for _ in range(steps + warmup):
        if before is not None:
            before()
        t0 = time.perf_counter()
        d_entry = digest_tensors_async(entry, "auto", stable=True)
        t1 = time.perf_counter()
        d_grads = digest_tensors_async(grads, "auto", owners=params, figures=figures)
        t2 = time.perf_counter()
        d_params = digest_tensors_async(params, "auto", stable=True, figures=figures)
        t3 = time.perf_counter()
        if prev is not None:
            prev_entry.result()
            for d in prev:
                d.result()
                d.figures()
        t4 = time.perf_counter()
        total.append(t4 - t0)
        parts.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        prev, prev_entry = (d_params, d_grads), d_entry
    by_part = {what: statistics.median(p[i] for p in parts[warmup:]) * 1e6
               for i, what in enumerate(PARTS)}
    return statistics.median(total[warmup:]) * 1e3, by_part
