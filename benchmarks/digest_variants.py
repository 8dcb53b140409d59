"""Launch configurations of the device digest's lanes kernel on the GPU at hand: BLOCK (lanes
per program), ITERS (vector steps per program) and num_warps, each timed against a plain
on-device read of the same contiguous state, digest alone and with figures, for fp32, bf16 and
fp16, and each checked against the shipped configuration's digests (the digest does not depend
on the configuration; the figures' float64 sums may differ in their last bits).

    python benchmarks/digest_variants.py [--mib 2048] [--reps 5]

Needs CUDA and Triton (exit 3 without). What it printed on an H100 is in docs/gpu.md; the
shipped defaults (hashing_triton.BLOCK, ITERS, NUM_WARPS) come from it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.run import _best_cuda as best  # noqa: E402  (one timing loop for every figure)

CONFIGS = [(1024, 16, 4), (1024, 16, 8), (2048, 8, 8), (512, 32, 4), (1024, 8, 4),
           (2048, 16, 8), (1024, 32, 8), (4096, 4, 16)]


def state(mib: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    dim = 4096
    shapes = [(dim, dim)] * 4 + [(3 * dim, dim), (dim, 3 * dim), (dim,), (dim,)]
    out, used, i = [], 0, 0
    while used < mib * 2**20:
        t = torch.randn(*shapes[i % len(shapes)], device="cuda", generator=g).to(dtype)
        out.append(t)
        used += t.nbytes
        i += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("digest_variants: no CUDA device: nothing measured")
        return 3
    from parity.capture import hashing_triton as ht

    os.environ[ht.ENV_GRAPHS] = "0"  # each configuration launched as such, never a replay
    shipped = (ht.BLOCK, ht.ITERS, ht.NUM_WARPS)
    print(f"digest_variants: {torch.cuda.get_device_name(0)}, shipped BLOCK/ITERS/warps {shipped}",
          flush=True)
    rows = []
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                         ("fp16", torch.float16)):
        ts = state(args.mib, dtype)
        ptrs = [t.data_ptr() for t in ts]
        nbytes = sum(t.nbytes for t in ts)
        t_read = best(lambda: [t.sum(dtype=torch.float32) for t in ts], args.reps)
        ref = None
        for block, iters, warps in CONFIGS:
            ht.NUM_WARPS = warps
            try:
                def go(fig):
                    p = ht._run(ts, ptrs, block=block, iters=iters, figures=fig)
                    if p is None:
                        raise RuntimeError(ht._state["failed"])
                    p.wait()
                    return p
                t_dig = best(lambda: go(False), args.reps)
                t_fig = best(lambda: go(True), args.reps)
                got = go(True).result()
                if ref is None:
                    ref = got
                same = "same" if got == ref else "DIFFERENT DIGESTS"
            except Exception as e:  # noqa: BLE001
                print(f"{label} {block}x{iters} w{warps}: FAILED {type(e).__name__}: {e}"[:300],
                      flush=True)
                ht._state["failed"] = None
                continue
            rows.append((label, block, iters, warps, t_read / t_dig, t_read / t_fig))
            print(f"{label} B{block:5d} I{iters:3d} w{warps:2d}  read {nbytes / t_read / 1e9:7.0f} GB/s"
                  f"  digest {nbytes / t_dig / 1e9:7.0f} ({t_read / t_dig:.3f}x)"
                  f"  figures {nbytes / t_fig / 1e9:7.0f} ({t_read / t_fig:.3f}x)  {same}",
                  flush=True)
        ht.NUM_WARPS = shipped[2]
        del ts
        torch.cuda.empty_cache()
    print("\nconfig            worst digest/read  worst figures/read")
    for cfg in CONFIGS:
        r = [x for x in rows if tuple(x[1:4]) == cfg]
        if r:
            print(f"B{cfg[0]} I{cfg[1]} w{cfg[2]}:".ljust(18)
                  + f"{min(x[4] for x in r):.3f}".ljust(19) + f"{min(x[5] for x in r):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
