"""The install a new user meets: a torch range that keeps an installed torch, README commands that
still get the tested CPU wheel, no top-level ``cli`` module in site-packages, ``python -m parity``."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(name: str) -> str:
    deps = PYPROJECT["project"]["dependencies"]
    return next(d for d in deps if re.match(rf"{name}\b", d))


def test_torch_is_a_tested_range_not_a_pin():
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(_requirement("torch")[len("torch"):])
    assert not any(s.operator == "==" for s in spec)
    for v in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"):  # docs/torch-versions.md
        assert v in spec, v
    assert "2.16.0" not in spec and "2.10.0" not in spec


def test_dependencies_have_no_unexplained_caps_and_no_pandas():
    names = [re.match(r"[A-Za-z0-9_.-]+", d).group(0) for d in PYPROJECT["project"]["dependencies"]]
    assert "pandas" not in names  # only the frames extra and dev use it
    assert "<" not in _requirement("rich")
    assert "pandas" in " ".join(PYPROJECT["project"]["optional-dependencies"]["frames"])


def test_distribution_name_and_entry_point():
    assert PYPROJECT["project"]["name"] == "fsdp-parity"
    assert PYPROJECT["project"]["scripts"]["parity"] == "parity.cli:main"
    assert "py-modules" not in PYPROJECT.get("tool", {}).get("setuptools", {})


def test_readme_commands_name_the_tested_torch_and_match_ci():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    installs = re.findall(r"^python3\.11 -m venv .*$", readme, flags=re.M)
    assert len(installs) == 2
    assert all("torch==2.13.0" in line for line in installs)
    # the README says where the CPU build comes from (PyPI's Linux wheel of 2.13.0 is the CUDA
    # build): a local file on this project's machines, else PyTorch's own CPU index
    assert "https://download.pytorch.org/whl/cpu" in readme and "/opt/wheels" in readme
    test_cmd = installs[1].split("&& ", 2)[2]  # after the venv and activate steps
    assert test_cmd.startswith("pip install") and test_cmd.endswith("pytest -q")
    assert test_cmd in ci.splitlines()


def test_python_dash_m_parity_and_repo_entry_point():
    for argv in ([sys.executable, "-m", "parity", "--version"],
                 [sys.executable, str(ROOT / "cli.py"), "--version"]):
        p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("parity ")


def test_wheel_installs_only_the_parity_package(tmp_path):
    import shutil

    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "parity", src / "parity",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "cli.py"):
        shutil.copy(ROOT / name, src / name)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(src)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {p.stderr.strip().splitlines()[-1:]}")
    wheel = next(tmp_path.glob("fsdp_parity-*.whl"))
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"parity"}
    names = zipfile.ZipFile(wheel).namelist()
    assert "parity/__main__.py" in names and "parity/cli.py" in names


def test_installing_keeps_the_installed_torch(tmp_path):
    """pip's own resolver, dry run: with this venv's torch (in the range) nothing but parity
    itself would be installed."""
    import json

    report = tmp_path / "report.json"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
                        "-q", "--report", str(report), "-e", str(ROOT)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"pip cannot resolve here: {p.stderr.strip().splitlines()[-1:]}")
    names = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert "torch" not in names and names == ["fsdp-parity"], names
