"""The random generators' state at each recorded step boundary (steps.jsonl ``rng``).

Why: dropout and every other random op draw from the default generators. Two runs whose
generators stand elsewhere (another seed, a seed per rank on one side, a draw one side makes
and the other does not: a sampler's seed, a probe layer built after seeding, a ``torch.rand``
for logging, inductor's own seeds, activation checkpointing that recomputes without
``preserve_rng_state``) differ from the first step in every hash while their bucket layouts
are identical, and nothing else recorded tells that from a numerical difference
(docs/reliability.md, "Round 13b"). The diff compares these digests step by step
(parity/diff/rng.py).

What is read: the xxh3-128 of ``torch.get_rng_state()`` (the CPU default generator: 5,056
bytes, a copy) and, where this process has initialised CUDA, of
``torch.cuda.get_rng_state()`` for the current device (its seed and offset, 16 bytes, read on
the host: no kernel, no sync). Read after each recorded step's optimizer step, from the step
hook, which runs no code inside a trace or a CUDA graph capture (steps.py). Reading a state
advances no generator. Never initialises CUDA. Any failure: nothing recorded for that step.
"""

from __future__ import annotations

import torch

from parity.capture.hashing import host_digest

__all__ = ["rng_digests"]


def _cuda_state() -> torch.Tensor | None:
    try:
        if not (torch.cuda.is_initialized() and torch.cuda.is_available()):
            return None  # never initialise CUDA for this
        if torch.cuda.is_current_stream_capturing():
            return None
        return torch.cuda.get_rng_state()
    except Exception:  # noqa: BLE001 - a torch without these: nothing recorded
        return None


def rng_digests() -> dict[str, str] | None:
    """``{"cpu": hex[, "cuda": hex]}``: the digests of the default generators' states now, or
    None where the CPU state cannot be read."""
    try:
        out = {"cpu": host_digest(torch.get_rng_state()).hex()}
    except Exception:  # noqa: BLE001
        return None
    cuda = _cuda_state()
    if cuda is not None:
        try:
            out["cuda"] = host_digest(cuda).hex()
        except Exception:  # noqa: BLE001
            pass
    return out
