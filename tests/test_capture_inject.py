"""Injection mechanics: which processes activate, what they import, the environment we set."""

import os
import subprocess
import sys
import types

import pytest

from parity.capture import env as inject_env
from parity.capture import post_import
from parity.capture.launch import BOOTSTRAP_DIR, capture_env

PY = "/usr/bin/python3"


def _run(code, **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARITY_CAPTURE")}
    env["PYTHONPATH"] = BOOTSTRAP_DIR
    env.update({k: str(v) for k, v in env_extra.items()})
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p


@pytest.mark.parametrize("argv,reason", [
    ([PY, "train.py"], None),
    ([PY, "-u", "train.py", "--launcher", "torchrun"], None),
    ([PY, "-m", "parity.workloads.train"], None),
    ([PY, "/venv/bin/torchrun", "--standalone", "train.py"], "torchrun agent"),
    ([PY, "-m", "torch.distributed.run", "train.py"], "torchrun agent"),
    ([PY, "-u", "-X", "importtime", "-m", "torch.distributed.launch", "x.py"], "torchrun agent"),
    ([PY, "-m", "torch._inductor.compile_worker", "--pickler=x"], "helper subprocess"),
    ([PY, "/site/torch/_inductor/compile_worker/__main__.py"], "helper subprocess"),
    ([PY, "-c", "from multiprocessing.resource_tracker import main;main(5)"], "helper subprocess"),
    ([PY, "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
      "--multiprocessing-fork"], None),  # may be an mp.spawn rank: activates lazily
])
def test_rank_skip_reason(argv, reason):
    env = {inject_env.ENV_DIR: "/tmp/x"}
    assert inject_env.rank_skip_reason(env, argv) == reason


def test_rank_skip_reason_marker_and_request():
    argv = [PY, "train.py"]
    assert inject_env.rank_skip_reason({}, argv) == "capture not requested"
    env = {inject_env.ENV_DIR: "/tmp/x", inject_env.ENV_ACTIVE: "1"}
    assert inject_env.rank_skip_reason(env, argv) == "a parent process is already a capturing rank"
    env[inject_env.ENV_ACTIVE] = str(os.getpid())
    assert inject_env.rank_skip_reason(env, argv) is None


def test_capture_env_only_adds_our_variables(tmp_path):
    base = {"PATH": "/bin", "PYTHONPATH": "/a:/b", "FOO": "1", inject_env.ENV_ACTIVE: "99"}
    env = capture_env(tmp_path, every=3, grads=False, manifests=True, hasher="device", base=base)
    assert env["PYTHONPATH"] == BOOTSTRAP_DIR + os.pathsep + "/a:/b"
    assert env[inject_env.ENV_DIR] == str(tmp_path)
    assert (env[inject_env.ENV_EVERY], env[inject_env.ENV_GRADS], env[inject_env.ENV_MANIFESTS],
            env[inject_env.ENV_HASHER]) == ("3", "0", "1", "device")
    assert inject_env.ENV_ACTIVE not in env
    assert {k: v for k, v in env.items() if not k.startswith("PARITY_CAPTURE")
            and k != "PYTHONPATH"} == {"PATH": "/bin", "FOO": "1"}
    assert capture_env(tmp_path, base={})["PYTHONPATH"] == BOOTSTRAP_DIR
    assert base[inject_env.ENV_ACTIVE] == "99"  # the caller's dict is not modified


def test_outside_a_captured_job_nothing_is_imported():
    p = _run("import sys; print('parity' in sys.modules, 'torch' in sys.modules)")
    assert p.stdout.split() == ["False", "False"]


def test_helpers_of_a_rank_import_nothing(tmp_path):
    p = _run("import sys; print('parity' in sys.modules)",
             PARITY_CAPTURE_DIR=tmp_path, PARITY_CAPTURE_ACTIVE="1")
    assert p.stdout.split() == ["False"]
    assert not list(tmp_path.iterdir())


def test_a_rank_waits_for_torch(tmp_path):
    code = ("import sys\n"
            "print(sorted(m for m in sys.modules if m.startswith('parity')))\n"
            "print('torch' in sys.modules)\n")
    p = _run(code, PARITY_CAPTURE_DIR=tmp_path, RANK=0, WORLD_SIZE=1)
    lines = p.stdout.splitlines()
    assert lines[0] == ("['parity', 'parity.capture', 'parity.capture.env', 'parity.capture.inject', "
                        "'parity.capture.post_import']")
    assert lines[1] == "False"
    assert not list(tmp_path.iterdir())  # no torch: nothing written


def test_a_rank_activates_on_import_torch(tmp_path):
    code = ("import os, torch\n"
            "from parity.capture import session\n"
            "s = session.current()\n"
            "marker = os.environ.get('PARITY_CAPTURE_ACTIVE') == str(os.getpid())\n"
            "print(s is not None, s.source, marker)\n")
    p = _run(code, PARITY_CAPTURE_DIR=tmp_path, RANK=0, WORLD_SIZE=1)
    assert p.stdout.split() == ["True", "exec", "True"]
    # a torchrun rank (RANK set) writes its meta.json at start
    assert (tmp_path / "rank-00000" / "meta.json").exists()


def test_user_sitecustomize_is_chained_and_keeps_its_name(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("VALUE = 42\n")
    code = "import sitecustomize; print(sitecustomize.VALUE, sitecustomize.__file__)"
    p = _run(code, PYTHONPATH=BOOTSTRAP_DIR + os.pathsep + str(user))
    value, path = p.stdout.split()
    assert value == "42" and path == str(user / "sitecustomize.py")


def test_a_failing_user_sitecustomize_is_reported_like_python_does(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("raise RuntimeError('user bug')\n")
    p = _run("print('ran')", PYTHONPATH=BOOTSTRAP_DIR + os.pathsep + str(user))
    assert p.stdout.strip() == "ran"
    assert "Error in sitecustomize" in p.stderr and "user bug" in p.stderr


def test_when_imported_runs_after_the_module_executed(tmp_path, monkeypatch):
    pkg = tmp_path / "pwatch_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    post_import.when_imported("pwatch_pkg.mod", lambda m: seen.append(m.X))
    assert seen == []
    import pwatch_pkg.mod  # noqa: F401

    assert seen == [1]
    assert post_import._finder not in sys.meta_path
    post_import.when_imported("pwatch_pkg.mod", lambda m: seen.append(2))  # already imported: now
    assert seen == [1, 2]
    # the loader is back to its class method
    assert "exec_module" not in vars(sys.modules["pwatch_pkg.mod"].__spec__.loader)


def test_when_imported_callback_errors_do_not_break_the_import(tmp_path, monkeypatch, capsys):
    (tmp_path / "pwatch_bad.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def boom(_m):
        raise ValueError("nope")

    post_import.when_imported("pwatch_bad", boom)
    import pwatch_bad

    assert pwatch_bad.Y == 2
    assert capsys.readouterr().err.strip() == "parity: capture disabled: ValueError: nope"
    assert isinstance(pwatch_bad, types.ModuleType)
