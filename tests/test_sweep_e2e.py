"""End to end: `parity sweep` on the built-in workload (parity exec + torchrun + diff), 2 cells."""

import json
import subprocess
import sys

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK

PARITY = [sys.executable, "-m", "parity"]


def test_default_sweep_two_cells(tmp_path):
    """The default sweep's story in two cells: under NCCL emulation at 2x2 (4 ranks), the
    upstream graph bucket order diverges in hashes; the registration order (the fix) holds."""
    out = tmp_path / "sweep"
    r = subprocess.run(PARITY + ["sweep", "--out", str(out), "--steps", "2",
                                 "--only", "flash=false,cudagraphs=false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    sweep = json.loads((out / "sweep.json").read_text())
    cells = {c["id"]: c for c in sweep["cells"]}
    graph = cells["bucket_order=graph,flash=false,cudagraphs=false"]
    fix = cells["bucket_order=registration,flash=false,cudagraphs=false"]
    assert r.returncode == EXIT_MISMATCH, (r.stderr[-3000:], graph["reason"], fix["reason"])
    assert sweep["counts"]["skipped"] == 6 and sweep["steps"] == 2
    for c in (graph, fix):
        assert c["diff"]["steps_compared"] == [0, 1, 2]
        assert (c["diff"]["a"]["bucket_source"], c["diff"]["b"]["bucket_source"]) == (
            "fsdp2", "graph"), c["reason"]
        for side in ("reference", "candidate"):
            s = c["sides"][side]
            assert s["status"] == "ok" and s["exit_code"] == 0
            assert (out / s["run_dir"] / "run.json").is_file()
            meta = json.loads((out / s["run_dir"] / "rank-00000" / "meta.json").read_text())
            assert meta["nccl_emulation"]["topology"] == "2x2:channels=4"
            assert len(s["rank_logs"]) == 4 and all((out / x["stderr"]).is_file()
                                                    for x in s["rank_logs"])
        assert (out / c["diff_json"]).is_file()
    # the bug: payloads in backward graph order are summed in other ring orders -> hashes differ
    assert graph["diff"]["verdict"] == "hash_mismatch" and graph["status"] == "hash_mismatch"
    assert graph["diff"]["first_divergent_step"] == 1
    assert graph["diff"]["order"]["verdict"] == "order_differs"
    assert graph["diff"]["reduction_order"]["verdict"] == "differs"  # predicted, too
    # the fix: registration order is bitwise identical to eager FSDP2
    assert fix["diff"]["verdict"] == "match" and fix["status"] == "match", fix["reason"]
    assert fix["diff"]["order"]["verdict"] == "identical"
    assert fix["diff"]["reduction_order"]["verdict"] == "same"
    # the gate agrees with the sweep's own exit code; the report renders
    g = subprocess.run(PARITY + ["gate", str(out)], capture_output=True, text=True, timeout=120)
    assert g.returncode == EXIT_MISMATCH, g.stdout
    md = subprocess.run(PARITY + ["report", str(out), "--format", "markdown"],
                        capture_output=True, text=True, timeout=120)
    assert md.returncode == 0 and "| registration | false | false |" in md.stdout

    # issue 21: a closed stdout keeps every exit code (report in each format, the gate)
    import os

    def closed(argv):
        r, w = os.pipe()
        os.close(r)
        try:
            return subprocess.run(PARITY + argv, stdout=w, stderr=subprocess.PIPE, text=True,
                                  timeout=120)
        finally:
            os.close(w)

    for fmt in ("console", "json", "markdown", "junit", "html"):
        p = closed(["report", str(out), "--format", fmt])
        assert p.returncode == EXIT_OK, (fmt, p.stderr)
    assert closed(["gate", str(out)]).returncode == EXIT_MISMATCH
    assert closed(["gate", str(out), "--fail-on", "order-only"]).returncode == EXIT_MISMATCH
    # issue 21: the gate checks the cells against the axes: a cell deleted from sweep.json
    # (complete: true left as is) is failed, not forgotten
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / ".parity-sweep").write_text((out / ".parity-sweep").read_text())
    sweep["cells"] = [c for c in sweep["cells"]
                      if c["id"] != "bucket_order=graph,flash=false,cudagraphs=false"]
    (edited / "sweep.json").write_text(json.dumps(sweep))
    g = subprocess.run(PARITY + ["gate", str(edited)], capture_output=True, text=True,
                       timeout=120)
    assert g.returncode == EXIT_INCOMPLETE, g.stdout
    assert "absent from sweep.json" in g.stdout
