"""Run by tests/test_capture_hashing_triton.py in a child process with TRITON_INTERPRET=1 (the
interpreter must be chosen before triton is first imported, so it cannot share pytest's process).
Prints one JSON object: case name -> [reference digest, kernel digest] (hex), plus the lanes of
every case, the row modes the table used and a hand-made row at positions near 2**31. Sizes are
tiny: the interpreter runs the kernels in numpy, one program at a time."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from parity.capture import digest_kernels, hashing, hashing_triton  # noqa: E402

BLOCK, ITERS = 8, 2  # 16 units per program: the tensors below span several programs


def flip(t, byte, bit):
    u = t.clone()
    u.view(torch.uint8).reshape(-1)[byte] ^= 1 << bit
    return u


def main():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, generator=g)
    b = torch.randn(67, generator=g).bfloat16()
    cases = {
        "float32": x,
        "bfloat16_2d": torch.randn(5, 7, generator=g).bfloat16(),
        "bfloat16_odd": b,
        "float16": torch.randn(33, generator=g).half(),
        "float8_e4m3fn": torch.randn(41, generator=g).to(torch.float8_e4m3fn),
        "int8": torch.randint(-128, 127, (29,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (70,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(23, generator=g) > 0.5,
        "int32": torch.randint(-2**31, 2**31 - 1, (17,), generator=g, dtype=torch.int32),
        "int64_wraps": torch.tensor([-1, -2, 2**63 - 1, -(2**63)] * 9, dtype=torch.int64),
        "float64_transposed": torch.randn(3, 4, generator=g, dtype=torch.float64).t(),
        "complex64": torch.randn(6, generator=g, dtype=torch.complex64),
        "complex128": torch.randn(5, generator=g, dtype=torch.complex128),
        "scalar": torch.tensor(2.5),
        "bf16_scalar": torch.tensor(2.5, dtype=torch.bfloat16),
        "unaligned_view": torch.randn(50, generator=g)[1:],  # not 16-byte aligned
        "bf16_at_odd_element": torch.randn(41, generator=g).bfloat16()[1:],  # not 4-byte aligned
        "uint8_at_3": torch.randint(0, 255, (40,), generator=g, dtype=torch.uint8)[3:],
        "exactly_two_chunks": torch.randn(2 * BLOCK * ITERS, generator=g),  # no tail row
        "bf16_two_chunks_and_a_half_word": torch.randn(4 * BLOCK * ITERS + 1, generator=g).bfloat16(),
        "empty": torch.zeros(0),
        "empty_bf16": torch.zeros(0, dtype=torch.bfloat16),
        "flip_first_bit": flip(x, 0, 0),
        "flip_last_bit": flip(x, 4 * 37 - 1, 7),
        "bf16_flip_last_bit": flip(b, 2 * 67 - 1, 7),
        "swap_across_programs": x[[20, *range(1, 20), 0, *range(21, 37)]],
        "bf16_swap_in_a_word": b[[1, 0, *range(2, 67)]],
        "bf16_swap_across_words": b[[3, 1, 2, 0, *range(4, 67)]],
    }
    # many small tensors of mixed dtypes and odd sizes, as a real parameter list
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8]
    for i in range(60):
        n = int(torch.randint(0, 45, (1,), generator=g))
        cases[f"small_{i}"] = torch.randn(n, generator=g).to(dtypes[i % len(dtypes)])
    names = list(cases)
    tensors = [cases[n] for n in names]
    ref = b"".join(hashing.finish(ln, t.numel() * t.element_size(), t.dtype)
                   for ln, t in zip(hashing.device_lanes_torch(tensors), tensors))
    got = hashing_triton.digest_interpreted(tensors, BLOCK, ITERS)  # one call: mixed table
    out = {n: [ref[16 * i:16 * i + 16].hex(), got[16 * i:16 * i + 16].hex()]
           for i, n in enumerate(names)}
    out["lanes"] = [hashing.device_lanes_torch(tensors),
                    hashing_triton.device_lanes(tensors, BLOCK, ITERS)]
    flat = [hashing_triton.materialized(t) for t in tensors]
    plan = hashing_triton._build([t.data_ptr() for t in flat], [t.nbytes for t in flat],
                                 [t.dtype for t in flat], torch.device("cpu"), BLOCK * ITERS)
    out["modes"] = sorted({int(m) for m in (plan.table[:plan.rows, 3] & 7).tolist()})
    out["rows"] = plan.rows

    # Positions near 2**31 (where a_k restarts at 1): a hand-made table row whose address is
    # moved back by `first` words, so that word index `first + k` reads word k.
    e = torch.randn(40, generator=g)
    first = 2**31 - 32  # a multiple of the chunk, as every row's first unit is
    rows = [[e.data_ptr() - first * 4, first + 40, first + s, digest_kernels.WORDS]
            for s in range(0, 40, BLOCK * ITERS)]
    lanes = torch.zeros(1, 4, dtype=torch.int64)
    digest_kernels.digest_lanes[(len(rows),)](torch.tensor(rows), lanes, lanes, BLOCK=BLOCK,
                                              ITERS=ITERS, B_MULT=hashing_triton.B_MULT,
                                              FIGURES=False)
    out["positions_past_2**31"] = [[v & 0xFFFFFFFF for v in e.view(torch.int32).tolist()], first,
                                   [v & (2**64 - 1) for v in lanes[0].tolist()]]
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
