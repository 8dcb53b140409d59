"""Whether two runs were computed under the same NCCL emulation (``parity exec --emulate-nccl``).

Emulation changes a job's numbers on purpose (each reduce-scatter and all-reduce summed in a
modelled NCCL Ring order), so an emulated run is comparable only with a run emulated under the
same topology and model: anything else would report differences the emulation itself made."""

from __future__ import annotations

from parity.errors import ParityError


def emulation_of(run) -> str | None:
    """'TOPOLOGY (MODEL)' the run was emulated under, or None for a plain run. Read from the
    ranks' meta.json (``nccl_emulation``), else from run.json (``capture.emulate_nccl``)."""
    for _, rd in sorted(run.ranks.items()):
        emu = (rd.meta or {}).get("nccl_emulation")
        if isinstance(emu, dict):
            return f"{emu.get('topology')} ({emu.get('model')})"
    cap = ((run.run_meta or {}).get("capture") or {})
    if cap.get("emulate_nccl"):
        return f"{cap['emulate_nccl']} (model unknown)"
    return None


def check_same_emulation(run_a, run_b) -> None:
    """ParityError (exit 2, one line) unless both runs are plain or emulated alike."""
    ea, eb = emulation_of(run_a), emulation_of(run_b)
    if ea == eb:
        return
    if ea is None or eb is None:
        which, emu = ("A", ea) if ea else ("B", eb)
        raise ParityError(f"cannot compare an NCCL-emulated run with a plain one: {which} was "
                          f"emulated at {emu}, the other was not; emulate both "
                          "(parity exec --emulate-nccl) or neither")
    raise ParityError(f"cannot compare runs emulated under different NCCL topologies: A {ea}, "
                      f"B {eb}")
