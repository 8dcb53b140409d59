"""End to end: `parity sweep` on the built-in workload (parity exec + torchrun + diff), 2 cells."""

import json
import subprocess
import sys

from parity.errors import EXIT_INCOMPLETE, EXIT_MISMATCH, EXIT_OK

PARITY = [sys.executable, "-m", "parity"]


def test_default_sweep_two_cells(tmp_path):
    out = tmp_path / "sweep"
    r = subprocess.run(PARITY + ["sweep", "--out", str(out), "--steps", "2",
                                 "--only", "flash=false,cudagraphs=false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    sweep = json.loads((out / "sweep.json").read_text())
    cells = {c["id"]: c for c in sweep["cells"]}
    ran = [cells["flash=false,cudagraphs=false,batch_size=1"],
           cells["flash=false,cudagraphs=false,batch_size=4"]]
    assert r.returncode == EXIT_OK, (r.stderr[-3000:], [c["reason"] for c in ran])
    assert sweep["counts"]["skipped"] == 6 and sweep["steps"] == 2
    for c in ran:
        # eager FSDP2 and the compiled job are bitwise identical on CPU; with the upstream
        # pass order (payloads in graph order) both sides' bucket manifests show the reorder
        assert c["diff"]["verdict"] == "match", c["reason"]
        assert c["diff"]["steps_compared"] == [0, 1, 2]
        assert (c["diff"]["a"]["bucket_source"], c["diff"]["b"]["bucket_source"]) == (
            "fsdp2", "graph"), c["reason"]
        assert c["diff"]["order"]["verdict"] == "order_differs", c["reason"]
        assert c["status"] == "order_mismatch"
        for side in ("reference", "candidate"):
            s = c["sides"][side]
            assert s["status"] == "ok" and s["exit_code"] == 0
            assert (out / s["run_dir"] / "run.json").is_file()
            assert len(s["rank_logs"]) == 2 and all((out / x["stderr"]).is_file()
                                                    for x in s["rank_logs"])
        assert (out / c["diff_json"]).is_file()
    # the report renders, the gate agrees with the sweep's own exit code
    g = subprocess.run(PARITY + ["gate", str(out)], capture_output=True, text=True, timeout=120)
    assert g.returncode == EXIT_OK, g.stdout
    g = subprocess.run(PARITY + ["gate", str(out), "--fail-on", "order-only"], capture_output=True,
                       text=True, timeout=120)
    assert g.returncode == EXIT_MISMATCH, g.stdout  # the reorder fails the order-only policy
    md = subprocess.run(PARITY + ["report", str(out), "--format", "markdown"],
                        capture_output=True, text=True, timeout=120)
    assert md.returncode == 0 and "| false | false | 4 |" in md.stdout

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
    assert closed(["gate", str(out)]).returncode == EXIT_OK
    assert closed(["gate", str(out), "--fail-on", "order-only"]).returncode == EXIT_MISMATCH
    # issue 21: the gate checks the cells against the axes: a cell deleted from sweep.json
    # (complete: true left as is) is failed, not forgotten
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / ".parity-sweep").write_text((out / ".parity-sweep").read_text())
    sweep["cells"] = [c for c in sweep["cells"]
                      if c["id"] != "flash=false,cudagraphs=false,batch_size=4"]
    (edited / "sweep.json").write_text(json.dumps(sweep))
    g = subprocess.run(PARITY + ["gate", str(edited)], capture_output=True, text=True,
                       timeout=120)
    assert g.returncode == EXIT_INCOMPLETE, g.stdout
    assert "absent from sweep.json" in g.stdout
