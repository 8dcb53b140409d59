"""Run by tests/test_capture_hashing_triton.py in a child process: compiles the device digest
kernels ahead of time for an H100 (sm_90) without a GPU (triton ships ptxas) and prints, per
kernel, the kinds of global loads, the 32x32->64-bit multiplies, the atomics (and float ones)
and the float64 fma in its PTX as JSON; the lanes kernel with and without figures. Catches
what the interpreter cannot: type errors of the real compiler, and lost vector loads."""

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from parity.capture import digest_kernels, hashing_triton


def _compile(fn, sig, consts):
    compiled = triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}},
                                        constexprs=consts),
                              target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    return {"loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
            "mul_wide": len(re.findall(r"m(?:ul|ad)\.wide\.u32", ptx)),
            "atomics": len(re.findall(r"atom\.global", ptx)),
            "float_atomics": len(re.findall(r"atom\.global[.\w]*\.f(?:16|32|64)", ptx)),
            "fma_f64": len(re.findall(r"fma\.rn\.f64", ptx)),
            "instructions": len(re.findall(r"^\s+[a-z]", ptx, re.M))}


def main():
    lanes_sig = {"table_ptr": "*i64", "out_ptr": "*i64", "fig_ptr": "*i64"}
    lanes_consts = {"BLOCK": hashing_triton.BLOCK, "ITERS": hashing_triton.ITERS,
                    "B_MULT": hashing_triton.B_MULT}
    out = {
        "digest_lanes": _compile(digest_kernels.digest_lanes, lanes_sig,
                                 {**lanes_consts, "FIGURES": False}),
        "digest_lanes_figures": _compile(digest_kernels.digest_lanes, lanes_sig,
                                         {**lanes_consts, "FIGURES": True}),
        "digest_finish": _compile(
            digest_kernels.digest_finish,
            {"lanes_ptr": "*i64", "keys_ptr": "*i64", "digest_ptr": "*i64", "n": "i32"},
            {"STRIDE": 5, "FBLOCK": hashing_triton.FBLOCK}),
        "figures_reduce": _compile(
            digest_kernels.figures_reduce,
            {"fig_ptr": "*i64", "keys_ptr": "*i64", "res_ptr": "*i64"},
            {"STRIDE": 5, "RBLOCK": hashing_triton.RBLOCK}),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
