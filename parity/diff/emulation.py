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
        emu = rd.meta.get("nccl_emulation") if isinstance(rd.meta, dict) else None
        if isinstance(emu, dict):
            return f"{emu.get('topology')} ({emu.get('model')})"
    meta = run.run_meta if isinstance(run.run_meta, dict) else {}
    cap = meta.get("capture") if isinstance(meta.get("capture"), dict) else {}
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


def emulation_gaps(run_a, run_b) -> list[str]:
    """What an emulated run left to gloo although the order matters (meta.json ``nccl_emulation``
    ``not_emulated``: a sparse gradient, a sub-group the model does not cover), one line per side
    and reason: the diff's ``incomplete`` list, so a verdict never holds on sums gloo made. A run
    written before ``not_emulated`` existed listed such groups under ``passed_to_gloo`` ("...
    summed by gloo"); they count too."""
    out = []
    for side, run in (("A", run_a), ("B", run_b)):
        gaps: dict[str, int] = {}
        ranks: dict[str, list[int]] = {}
        for r, rd in sorted(run.ranks.items()):
            emu = rd.meta.get("nccl_emulation") if isinstance(rd.meta, dict) else None
            if not isinstance(emu, dict):
                continue
            found = dict(emu.get("not_emulated") or {}) if isinstance(
                emu.get("not_emulated"), dict) else {}
            old = emu.get("passed_to_gloo")
            if "not_emulated" not in emu and isinstance(old, dict):
                found.update({k: v for k, v in old.items() if "summed by gloo" in str(k)})
            for reason, n in found.items():
                gaps[str(reason)] = gaps.get(str(reason), 0) + (n if isinstance(n, int) else 1)
                ranks.setdefault(str(reason), []).append(r)
        for reason, n in gaps.items():
            rs = ranks[reason]
            where = f"rank {rs[0]}" if len(rs) == 1 else f"{len(rs)} ranks"
            out.append(f"{side}: {n} reduction(s) not emulated, summed by gloo ({where}): "
                       f"{reason}")
    return out
