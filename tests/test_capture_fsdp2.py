"""FSDP2 manifest recorder: feature detection and fail-soft (the layouts are tested end to end
in test_capture_exec.py against what FSDP2 really passed to its collectives)."""

import os
import subprocess
import sys

import pytest
import torch

from parity.artifacts import read_run
from parity.capture.sources import fsdp2
from parity.capture.sources.manifest_source import SourceHooks


def _recorder(warnings, emitted=None):
    return fsdp2.FSDP2Recorder(SourceHooks(
        emit=(emitted if emitted is not None else []).append, on_graph=None, on_loss=None,
        done=lambda: 0, warn=warnings.append, lost=warnings.append,
        fail=lambda e: pytest.fail(f"fail called: {e}")))


def test_missing_internal_is_one_warning(monkeypatch):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    monkeypatch.delattr(pg, "foreach_reduce")
    warnings = []
    assert _recorder(warnings).install() == (f"{fsdp2.GROUP_MODULE}.foreach_reduce not "
                                             f"found (torch {torch.__version__})")
    assert warnings == []  # the session says it (FSDP2Recorder.unavailable + the reason)


def test_changed_signature_is_one_warning(monkeypatch):
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    monkeypatch.setattr(pg, "foreach_all_gather", lambda params, pg_, *a: None)
    warnings = []
    assert _recorder(warnings).install() == (f"{fsdp2.GROUP_MODULE}.foreach_all_gather "
                                             f"has an unexpected signature (torch {torch.__version__})")
    assert warnings == []


def test_install_wraps_and_uninstall_restores():
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    ag, rs = pg.foreach_all_gather, pg.foreach_reduce
    warnings = []
    r1, r2 = _recorder(warnings), _recorder(warnings)
    assert r1.install() is None and pg.foreach_all_gather is not ag
    assert r2.install() is None and pg.foreach_all_gather.__wrapped__ is ag  # not wrapped twice
    r2.uninstall()
    assert pg.foreach_all_gather is ag and pg.foreach_reduce is rs
    r1.uninstall()  # its wrapper is gone already: nothing to restore, nothing broken
    assert pg.foreach_all_gather is ag and warnings == []


def test_job_with_changed_fsdp2_internals_still_hashes(tmp_path):
    """A 1-rank FSDP2 job whose foreach_reduce has another signature: one warning, no
    manifests, hashes as usual."""
    code = f"""
import os, socket
import torch, torch.nn as nn, torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg
from torch.distributed.fsdp import fully_shard
import parity.capture
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
orig = pg.foreach_reduce
pg.foreach_reduce = lambda *args, **kwargs: orig(*args, **kwargs)  # names not visible
session = parity.capture.start({str(tmp_path / 'run')!r})
m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
fully_shard(m)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(2):
    m(torch.ones(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
dist.destroy_process_group()
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("parity:")]
    assert lines == [f"parity: FSDP2 manifests unavailable: {fsdp2.GROUP_MODULE}.foreach_reduce "
                     f"has an unexpected signature (torch {torch.__version__})"]
    rd = read_run(tmp_path / "run").ranks[0]
    assert sorted(rd.steps) == [0, 1, 2] and rd.buckets == []
    assert rd.steps[2]["grad_digest"] is not None
    # FSDP2 imports DTensor, whose eager collectives are hooked, and c10d, whose all-reduces
    # are (none is issued here)
    assert set(rd.meta["capture"]["manifests"]) <= {"dtensor", "c10d"}
    assert rd.meta["capture"]["warnings"] == [lines[0].removeprefix("parity: ")]
