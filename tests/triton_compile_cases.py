"""Run by tests/test_capture_hashing_triton.py in a child process: compiles the device digest
kernel ahead of time for an H100 (sm_90) without a GPU (triton ships ptxas) and prints, per
variant, the kinds of global loads and 64-bit multiplies in its PTX as JSON. Catches what the
interpreter cannot: type errors of the real compiler, and lost vector loads."""

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from parity.capture import hashing_triton

VARIANTS = [(4, True, False), (2, True, False), (8, False, True)]


def main():
    kernel = hashing_triton._kernel()
    out = {}
    for width, aligned, masked in VARIANTS:
        consts = {"WIDTH": width, "ALIGNED": aligned, "MASKED": masked,
                  "BLOCK": hashing_triton.BLOCK, "ITERS": hashing_triton.ITERS,
                  "B_MULT": hashing_triton.B_MULT}
        sig = {"table_ptr": "*i64", "out_ptr": "*i64", **{k: "constexpr" for k in consts}}
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32))
        ptx = compiled.asm["ptx"]
        out[f"{width},{int(aligned)},{int(masked)}"] = {
            "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
            "mul_wide": len(re.findall(r"m(?:ul|ad)\.wide\.u32", ptx)),
            "atomics": len(re.findall(r"atom\.global", ptx)),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
