"""Run by tests/test_capture_hashing_triton.py in a child process with TRITON_INTERPRET=1 (the
interpreter must be chosen before triton is first imported, so it cannot share pytest's process).
Prints one JSON object: case name -> [reference lanes, kernel lanes]. Sizes are tiny: the
interpreter runs the kernel in numpy, one program at a time."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from parity.capture import hashing, hashing_triton  # noqa: E402

BLOCK, ITERS = 8, 2  # 16 elements per program: the tensors below span several programs


def kernel(tensors):
    lanes = hashing_triton.device_lanes([hashing._elements(t) for t in tensors], BLOCK, ITERS)
    if lanes is None:
        sys.exit(f"kernel failed: {hashing_triton._state['failed']}")
    return lanes


def flip(t, byte, bit):
    u = t.clone()
    u.view(torch.uint8).reshape(-1)[byte] ^= 1 << bit
    return u


def main():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, generator=g)
    cases = {
        "float32": x,
        "bfloat16_2d": torch.randn(5, 7, generator=g).bfloat16(),
        "float16": torch.randn(33, generator=g).half(),
        "float8_e4m3fn": torch.randn(41, generator=g).to(torch.float8_e4m3fn),
        "int8": torch.randint(-128, 127, (29,), generator=g, dtype=torch.int8),
        "uint8": torch.randint(0, 255, (70,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(23, generator=g) > 0.5,
        "int32": torch.randint(-2**31, 2**31 - 1, (17,), generator=g, dtype=torch.int32),
        "int64_wraps": torch.tensor([-1, -2, 2**63 - 1, -(2**63)] * 9, dtype=torch.int64),
        "float64_transposed": torch.randn(3, 4, generator=g, dtype=torch.float64).t(),
        "complex64": torch.randn(6, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(2.5),
        "unaligned_view": torch.randn(50, generator=g)[1:],  # address not 16-byte aligned
        "exactly_two_chunks": torch.randn(2 * BLOCK * ITERS, generator=g),  # no tail row
        "empty": torch.zeros(0),
        "flip_first_bit": flip(x, 0, 0),
        "flip_last_bit": flip(x, 4 * 37 - 1, 7),
        "swap_across_programs": x[[20, *range(1, 20), 0, *range(21, 37)]],
    }
    names = list(cases)
    tensors = [cases[n] for n in names]
    ref = hashing.device_lanes_torch(tensors)
    got = kernel(tensors)  # one call for all: the table mixes widths and tensors
    out = {n: [r, k] for n, r, k in zip(names, ref, got)}
    _, launches = next(reversed(hashing_triton._tables.values()))
    out["launches"] = [[w, a, m] for w, a, m, _, _ in launches]

    # Positions near 2**31 (where a_i restarts at 1): a hand-made table row whose address is
    # moved back by `first` elements, so that element index `first + k` reads element k.
    e = hashing._elements(torch.randn(40, generator=g))
    first = 2**31 - 32  # a multiple of the chunk, as every row's first element is
    rows = [[e.data_ptr() - first * 4, first + 40, first + s, 0] for s in range(0, 40, BLOCK * ITERS)]
    lanes = torch.zeros(1, 4, dtype=torch.int64)
    hashing_triton._kernel()[(len(rows),)](torch.tensor(rows), lanes, WIDTH=4, ALIGNED=False,
                                           MASKED=True, BLOCK=BLOCK, ITERS=ITERS,
                                           B_MULT=hashing_triton.B_MULT)
    out["positions_past_2**31"] = [[v & 0xFFFFFFFF for v in e.tolist()], first,
                                   [v & (2**64 - 1) for v in lanes[0].tolist()]]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
