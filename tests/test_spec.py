"""Sweep spec parsing, validation and matrix expansion (parity/sweep/spec.py)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parity.errors import EXIT_USAGE, SpecError
from parity.sweep.spec import (BUILTIN_ENTRY, cell_id, default_spec_path, load_spec, matches,
                               parse_only, parse_spec, safe_component)

REPO = Path(__file__).resolve().parents[1]
PARITY = [sys.executable, "-m", "parity"]

MINIMAL = """
name = "t"
[axes]
x = [1, 2]
[reference]
argv = ["-m", "mod", "--x", "{x}"]
[candidate]
argv = ["-m", "mod", "--x", "{x}", "--compiled"]
"""


def spec(text: str, **kw):
    return parse_spec(textwrap.dedent(text), source="s.toml", **kw)


def error(text: str) -> str:
    with pytest.raises(SpecError) as e:
        spec(text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("s.toml: ")
    return msg


# ------------------------------------------------------------------------------ shipped specs


def test_default_spec_is_package_data_and_the_repo_copy_is_the_same_file():
    p = default_spec_path()
    assert p.is_file() and p.parent.name == "sweeps" and p.parent.parent.name == "parity"
    repo_copy = REPO / "sweeps" / "cpu-default.toml"
    assert repo_copy.resolve() == p.resolve()  # a symbolic link: one source of truth


def test_default_spec_expands_to_the_documented_matrix():
    sp = load_spec(None)
    assert sp.name == "cpu-default" and sp.steps == 3 and sp.nproc_per_node == 4
    assert sp.emulate_nccl == "2x2:channels=4"  # NCCL Ring emulation at 2 nodes x 2 GPUs
    assert sp.at == "2x2:channels=4"  # and the prediction at the same topology
    assert [a.name for a in sp.axes] == ["bucket_order", "flash", "cudagraphs"]
    cells = sp.cells()
    assert len(cells) == 8
    c = next(c for c in cells
             if c.axes == {"bucket_order": "registration", "flash": True, "cudagraphs": True})
    assert c.requires == ["cuda"]
    ref, cand = c.sides["reference"].entry_argv, c.sides["candidate"].entry_argv
    assert ref[:2] == BUILTIN_ENTRY and cand[:2] == BUILTIN_ENTRY
    assert "--bucket-order" in cand and cand[cand.index("--bucket-order") + 1] == "registration"
    assert "--bucket-order" not in ref
    assert ref[-2:] == ["--attention", "flash"] and "--cudagraphs" not in ref  # candidate only
    assert cand[-3:] == ["--attention", "flash", "--cudagraphs"]
    assert "--steps" in cand
    assert c.sides["reference"].env == {"OMP_NUM_THREADS": "1"}
    g = next(c for c in cells if c.axes["bucket_order"] == "graph")
    gc = g.sides["candidate"].entry_argv
    assert gc[gc.index("--bucket-order") + 1] == "graph"


def test_emulate_nccl_key_is_checked_against_the_world_size():
    base = ('name = "t"\nnproc_per_node = 2\n[reference]\nbuiltin = true\n'
            '[candidate]\nbuiltin = true\n')
    with pytest.raises(SpecError, match="emulate_nccl: '2x2' needs 4 ranks"):
        parse_spec('emulate_nccl = "2x2"\n' + base)
    with pytest.raises(SpecError, match="emulate_nccl: .*expected NODESxGPUS"):
        parse_spec('emulate_nccl = "two"\n' + base)
    sp = parse_spec('emulate_nccl = "1x2"\n' + base)
    plain = parse_spec(base)
    assert sp.emulate_nccl == "1x2" and plain.emulate_nccl is None
    c, p = sp.cells()[0], plain.cells()[0]  # an emulated cell is never resumed from a plain one
    assert c.sides["reference"].fingerprint(sp, c) != p.sides["reference"].fingerprint(plain, p)


def test_cuda_default_spec_runs_cuda_graphs_on_the_candidate_only():
    p = default_spec_path(cuda=True)
    assert p.name == "cuda-default.toml" and p.is_file()
    assert (REPO / "sweeps" / "cuda-default.toml").resolve() == p.resolve()
    assert default_spec_path(cuda=False).name == "cpu-default.toml"
    sp = load_spec(p)
    assert sp.name == "cuda-default" and sp.env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert [a.name for a in sp.axes] == ["bucket_order", "flash", "cudagraphs"]
    for c in sp.cells():
        ref, cand = c.sides["reference"].entry_argv, c.sides["candidate"].entry_argv
        assert c.requires == ["cuda"]  # runs on one GPU: no cell needs two
        assert ref[ref.index("--device") + 1] == "cuda" == cand[cand.index("--device") + 1]
        assert "--cudagraphs" not in ref
        assert ("--cudagraphs" in cand) == c.axes["cudagraphs"]
        backend = "nccl" if c.axes["cudagraphs"] else "gloo"  # CUDA graphs cannot capture gloo
        assert ref[ref.index("--backend") + 1] == backend == cand[cand.index("--backend") + 1]
        assert cand[cand.index("--bucket-order") + 1] == c.axes["bucket_order"]
        if c.axes["flash"]:  # FLASH on CUDA has no float32 kernel
            assert ref[ref.index("--param-dtype") + 1] == "bfloat16" == cand[cand.index("--param-dtype") + 1]
            # and its reduce-scatter in bf16: a float32 reduce of bf16 gradients at 4 ranks is
            # almost always exact, and the graph-order cell then showed no divergence (H100)
            assert ref[ref.index("--reduce-dtype") + 1] == "bfloat16" == cand[cand.index("--reduce-dtype") + 1]


@pytest.mark.parametrize("name,cells", [("cpu-default", 8), ("cuda-default", 8),
                                        ("torchtitan-llama3-8gpu", 8),
                                        ("torchtitan-dsv3-16gpu", 4)])  # dsv3: no CUDA graphs
def test_shipped_specs_validate(name, cells):
    sp = load_spec(REPO / "sweeps" / f"{name}.toml")
    assert sp.name == name and len(sp.cells()) == cells


def test_torchtitan_templates_use_per_side_flags_and_slurm():
    ds = load_spec(REPO / "sweeps" / "torchtitan-dsv3-16gpu.toml")
    assert ds.nnodes == 2 and ds.launcher.type == "slurm" and ds.launcher.options["gpus_per_node"] == 8
    c = next(c for c in ds.cells() if c.axes["cudagraphs"] is False and c.axes["batch_size"] == 16)
    ref, cand = c.sides["reference"].entry_argv, c.sides["candidate"].entry_argv
    assert "--training.disable_cuda_graphs" in ref and "--training.disable_cuda_graphs" not in cand
    assert cand[cand.index("--compile.disable_passes") + 1] == "cudagraph_pass"
    assert "--debug.deterministic" in ref and "--debug.deterministic" in cand


# ------------------------------------------------------------------------------ expansion


def test_placeholders_flags_and_side_overrides():
    sp = spec("""
        name = "t"
        steps = 7
        seed = 3
        nproc_per_node = 4
        [env]
        A = "{x}-{side}"
        [axes.x]
        values = [1, 2]
        flags = { 1 = ["--one"], 2 = ["--two", "{{literal}}"] }
        [axes.mode]
        values = ["fast", "slow"]
        requires = { slow = ["module:json"] }
        [reference]
        builtin = true
        args = ["--x={x}", "--steps", "{steps}", "--seed", "{seed}", "--ws", "{world_size}"]
        [candidate]
        argv = ["train.py", "{cell}", "{run_dir}"]
        env = { B = "{mode}" }
        [candidate.flags.x]
        1 = ["--cand-one"]
    """)
    cells = sp.cells(steps=5, sweep_dir="/out")
    assert [c.id for c in cells] == ["x=1,mode=fast", "x=1,mode=slow", "x=2,mode=fast",
                                     "x=2,mode=slow"]
    c = cells[1]
    assert c.requires == ["module:json"]
    assert c.sides["reference"].entry_argv == BUILTIN_ENTRY + [
        "--x=1", "--steps", "5", "--seed", "3", "--ws", "4", "--one"]
    assert c.sides["candidate"].entry_argv == [
        "train.py", "x=1,mode=slow", "/out/cells/x=1,mode=slow/candidate", "--cand-one"]
    assert c.sides["reference"].env == {"A": "1-reference"}
    assert c.sides["candidate"].env == {"A": "1-candidate", "B": "slow"}
    assert cells[2].sides["reference"].entry_argv[-2:] == ["--two", "{literal}"]
    assert cells[2].sides["candidate"].entry_argv[-1] != "--two"  # the side's own table wins


def test_no_axes_is_one_cell():
    sp = spec("""
        [reference]
        argv = ["a.py"]
        [candidate]
        argv = ["b.py"]
    """)
    assert sp.name == "s" and [c.id for c in sp.cells()] == ["base"]


def test_only_filter():
    sp = spec(MINIMAL + '\n[axes.f]\nvalues = [true, false]\n'.replace("[axes.f]", "[axes.f]"))
    sel = parse_only("x=2, f=TRUE", sp)
    assert [c.id for c in sp.cells() if matches(c, sel)] == ["x=2,f=true"]
    assert len([c for c in sp.cells() if matches(c, parse_only("x=1|2", sp))]) == 4
    for bad, needle in [("y=1", "unknown axis"), ("x=3", "not a value"), ("x", "AXIS=VALUE")]:
        with pytest.raises(SpecError, match=needle):
            parse_only(bad, sp)


# ------------------------------------------------------------------------------ ids and paths


@pytest.mark.parametrize("value", ["../../etc", "a/b", "..", ".", "a b", "$(touch x)", "`id`",
                                   "x;rm -rf /", "a|b&c>d<e", "\x00\n", "é", "-rf", "*" * 300])
def test_cell_ids_are_safe_path_components(value):
    cid = cell_id({"v": value})
    assert "/" not in cid and "\\" not in cid and cid not in (".", "..")
    assert all(ch.isalnum() or ch in "._+-=," for ch in cid), cid
    assert len(cid) < 100
    assert os.path.normpath(os.path.join("out", cid)).startswith("out" + os.sep)


def test_distinct_values_never_share_a_cell_id():
    values = ["a/b", "a_b", "a b", "a:b", "a\\b"]
    assert len({safe_component(v) for v in values}) == len(values)
    assert safe_component("plain-1.5") == "plain-1.5"


# ------------------------------------------------------------------------------ validation


def test_invalid_toml():
    assert "invalid TOML" in error("name = \n")


def test_unknown_keys_everywhere():
    assert "argvv: unknown key" in error(MINIMAL.replace("argv = [\"-m\", \"mod\", \"--x\", \"{x}\"]\n",
                                                         "argvv = []\n", 1))
    assert "s.toml: stepz: unknown key" in error("stepz = 3\n" + MINIMAL)
    msg = error(MINIMAL.replace("x = [1, 2]", "x = { values = [1], flagz = {} }"))
    assert "axes.x.flagz: unknown key" in msg
    assert "launcher.partitionz" in error(MINIMAL + '[launcher]\ntype = "slurm"\npartitionz = "a"\n')


def test_unknown_placeholder():
    msg = error(MINIMAL.replace("{x}\"]\n[candidate]", "{y}\"]\n[candidate]"))
    assert "reference.argv[3]: unknown placeholder {y}" in msg
    assert "unknown placeholder {bogus}" in error(MINIMAL + '[env]\nA = "{bogus}"\n')
    assert "unmatched" in error(MINIMAL.replace('"--compiled"', '"{x"'))


def test_empty_axis_and_bad_values():
    assert "axes.x.values: empty axis" in error(MINIMAL.replace("x = [1, 2]", "x = []"))
    assert "duplicate value" in error(MINIMAL.replace("x = [1, 2]", "x = [1, 1]"))
    assert "axes.x.values[0]: must be a string" in error(MINIMAL.replace("x = [1, 2]", "x = [[1]]"))
    assert "reserved placeholder" in error(MINIMAL.replace("x = [1, 2]", "steps = [1, 2]"))
    assert "not a value of axis x" in error(MINIMAL.replace("x = [1, 2]",
                                                            "x = { values = [1], flags = { 2 = [] } }"))


@pytest.mark.parametrize("line,needle", [
    ("steps = \"3\"", "steps: must be an integer, not a string"),
    ("steps = true", "steps: must be an integer, not a boolean"),
    ("steps = 0", "steps: must be >= 1"),
    ("timeout = -1", "timeout: must be > 0"),
    ("nproc_per_node = 1.5", "nproc_per_node: must be an integer, not a float"),
    ("env = { A = 1 }", "env.A: must be a string"),
    ("requires = [\"gpu\"]", "unknown requirement 'gpu'"),
    ("capture = \"yes\"", "capture: must be true or false"),
    ("launcher = \"k8s\"", "launcher.type: 'k8s': must be one of local, slurm"),
    ("name = \"a b\"", "name: 'a b'"),
])
def test_wrong_types(line, needle):
    assert needle in error(line + "\n" + MINIMAL.replace('name = "t"\n', ""))


def test_argv_must_be_a_list_not_a_shell_string():
    msg = error(MINIMAL.replace('argv = ["-m", "mod", "--x", "{x}"]', 'argv = "python -m mod"'))
    assert "reference.argv: must be a list of strings" in msg and "shell string" in msg
    assert "reference.argv[1]: must be a string, not an integer" in error(
        MINIMAL.replace('argv = ["-m", "mod", "--x", "{x}"]', 'argv = ["-m", 5]'))


def test_sides_are_required_and_builtin_rules():
    assert "missing [candidate] table" in error(MINIMAL.split("[candidate]")[0])
    assert "reference.args: only used with builtin" in error(
        MINIMAL.replace('argv = ["-m", "mod", "--x", "{x}"]', 'args = ["--x"]'))
    assert "reference.argv: not allowed with builtin" in error(
        MINIMAL.replace('argv = ["-m", "mod", "--x", "{x}"]', 'builtin = true\nargv = ["a"]'))
    assert "reference.flags.nope: no axis named" in error(MINIMAL + "[reference.flags.nope]\n")


def test_launcher_table():
    sp = spec(MINIMAL + '[launcher]\ntype = "slurm"\npartition = "gpu"\ntime = "01:00:00"\n'
              'gpus_per_node = 8\nsbatch_options = ["--exclusive"]\n')
    assert sp.launcher.type == "slurm" and sp.launcher.options["time"] == "01:00:00"
    assert spec('launcher = "local"\n' + MINIMAL).launcher.type == "local"
    assert "launcher.time" in error(MINIMAL + '[launcher]\ntime = "soon"\n')
    assert "launcher.nodes: 2 differs from nnodes = 1" in error(MINIMAL + "[launcher]\nnodes = 2\n")
    assert "launcher.sbatch_options" in error(MINIMAL + '[launcher]\nsbatch_options = "--x"\n')


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.toml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


# ------------------------------------------------------------------------------ through the CLI


@pytest.mark.parametrize("text,key", [
    ("name = \"t\"\n[axes\n", "invalid TOML"),
    ("bogus = 1\n" + MINIMAL, "bogus: unknown key"),
    (MINIMAL.replace("{x}\"]\n[candidate]", "{nope}\"]\n[candidate]"), "unknown placeholder {nope}"),
    (MINIMAL.replace("x = [1, 2]", "x = []"), "axes.x.values: empty axis"),
    (MINIMAL.replace('name = "t"', "name = 5"), "name: must be a string"),
])
def test_cli_spec_errors_exit_2_with_one_line_naming_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    out = tmp_path / "out"
    r = subprocess.run(PARITY + ["sweep", str(path), "--out", str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_USAGE, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parity: error: bad.toml: "), r.stderr
    assert key in lines[0]
    assert not out.exists()  # nothing launched, nothing created


# ------------------------------------------------------------------ per-value world overrides


def test_an_axis_value_sets_its_cells_world_and_emulation():
    """cuda-default.toml: the CUDA-graph cells run one rank on NCCL without the spec's emulation
    or prediction; the others run the spec's 4 emulated ranks."""
    from parity.sweep.spec import default_spec_path, load_spec

    sp = load_spec(default_spec_path(cuda=True))
    cells = {c.id: c for c in sp.cells()}
    assert len(cells) == 8
    for cid, c in cells.items():
        if "cudagraphs=true" in cid:
            assert (c.nproc_per_node, c.emulate_nccl, c.at) == (1, None, None)
            assert "--cudagraphs" in c.sides["candidate"].entry_argv
        else:
            assert (c.nproc_per_node, c.emulate_nccl, c.at) == (4, "2x2:channels=4",
                                                                 "2x2:channels=4")
    # the reference of the two bucket orders is one job (same fingerprint), per world
    fps = {c.sides["reference"].fingerprint(sp, c) for c in cells.values()}
    assert len(fps) == 4


def test_axis_set_is_validated():
    base = """
name = "t"
[axes.flash]
values = [true, false]
[reference]
argv = ["-m", "mod"]
[candidate]
argv = ["-m", "mod", "--compiled"]
"""
    sp = spec(base + '[axes.flash.set.true]\nnproc_per_node = 4\nemulate_nccl = "2x2"\n')
    c = {c.id: c for c in sp.cells()}
    assert c["flash=true"].nproc_per_node == 4 and c["flash=true"].emulate_nccl == "2x2"
    assert c["flash=false"].emulate_nccl is None and c["flash=false"].nproc_per_node == 2
    for bad, why in (
            ('[axes.flash.set.true]\nnproc_per_node = 2\nemulate_nccl = "2x2"\n', "needs 4 ranks"),
            ('[axes.flash.set.maybe]\nnproc_per_node = 1\n', "not a value of axis flash"),
            ('[axes.flash.set.true]\nthreads = 1\n', "unknown key"),
            ('[axes.flash.set.true]\nat = "2y2"\n', "at")):
        assert why in error(base + bad), bad


def test_cuda_default_dry_run_runs_each_cell_at_its_own_world(tmp_path):
    """The per-value world reaches the jobs: emulated cells at 4 ranks under the 2x2 emulation,
    CUDA-graph cells at one rank on NCCL without it (the commands a --dry-run prints)."""
    proc = subprocess.run([*PARITY, "sweep", str(default_spec_path(cuda=True)), "--dry-run",
                           "--out", str(tmp_path / "s")], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cell, seen = None, 0
    for line in proc.stdout.splitlines():
        if line.startswith("bucket_order="):
            cell = line.split()[0]
        elif line.strip().startswith(("reference:", "candidate:")) and "torch.distributed.run" in line:
            seen += 1
            if "cudagraphs=true" in cell:
                assert "--nproc_per_node 1 " in line and "--emulate-nccl" not in line
                assert "--backend nccl" in line
            else:
                assert "--nproc_per_node 4 " in line and "--emulate-nccl 2x2:channels=4" in line
                assert "--backend gloo" in line
    assert seen >= 12  # 16 on CPU (all skipped); on a GPU the two orders share their reference
