"""Sweep specs: a TOML file that names a matrix of axes and the two sides to compare in each cell.

``load_spec`` reads and validates a whole spec before anything runs; every problem is a
:class:`~parity.errors.SpecError` whose one-line message names the file, the key and the problem.
``Spec.cells`` expands the matrix into :class:`Cell` objects, each holding the fully substituted
argv of both sides. docs/sweep.md describes the format; this module is its only reader.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from parity.errors import ParityError, SpecError
from parity.nccl import parse_topology
from parity.sweep import launchers, torchtitan_args

SIDES = ("reference", "candidate")
CELLS_DIR = "cells"  # SWEEP_DIR/cells/CELL_ID/{cell.json,diff.json,reference/,candidate/,logs/}
BUILTIN_ENTRY = ["-m", "parity.workloads.train"]
LAUNCHERS = launchers.NAMES  # the registry (launchers.py) is the one list of launcher names
DEFAULT_TIMEOUT = 1800.0

# Placeholders every spec may use besides its axis names.
RESERVED_PLACEHOLDERS = ("steps", "seed", "nproc_per_node", "nnodes", "world_size", "side", "cell",
                         "run_dir")

_TOP_KEYS = {"name", "description", "steps", "seed", "nproc_per_node", "nnodes", "timeout", "env",
             "tolerate_teardown_exit", "at", "control", "stop_after_divergence", "emulate_nccl",
             "workdir", "requires", "capture", "axes", "reference", "candidate", "launcher"}
_AXIS_KEYS = {"values", "flags", "requires", "set"}
# what an axis value may set for its cells instead of the spec's top-level value ("" turns
# emulate_nccl / at off): e.g. CUDA-graph cells at one rank on NCCL in an emulated sweep
_CELL_KEYS = ("nproc_per_node", "emulate_nccl", "at")
_SIDE_KEYS = {"label", "builtin", "args", "argv", "env", "flags"}
_SLURM_KEYS = {"partition": str, "nodes": int, "ntasks_per_node": int, "gpus_per_node": int,
               "time": (str, int), "account": str, "sbatch_options": list}
_LAUNCHER_KEYS = {"type", *_SLURM_KEYS}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PLACEHOLDER_RE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_SIMPLE_REQUIREMENTS = ("cuda",)
_PREFIX_REQUIREMENTS = ("gpus", "module", "command", "env", "launcher")


def default_spec_path(cuda: bool | None = None) -> Path:
    """The default spec, shipped as package data (``sweeps/*-default.toml`` link to it): the CUDA
    variant where this machine has a CUDA device (``cuda`` None: detect), the CPU one elsewhere."""
    from importlib.resources import files

    if cuda is None:
        from parity.sweep.launcher import local_cuda_devices

        cuda = local_cuda_devices() > 0
    name = "cuda-default.toml" if cuda else "cpu-default.toml"
    return Path(str(files("parity") / "sweeps" / name))


def value_key(value) -> str:
    """The canonical text of an axis value: TOML table keys, --only, cell ids and placeholders."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


# --------------------------------------------------------------------------------------- model


@dataclass
class Axis:
    name: str
    values: list
    flags: dict[str, list[str]] = field(default_factory=dict)  # value key -> args (both sides)
    requires: dict[str, list[str]] = field(default_factory=dict)  # value key -> requirements
    sets: dict[str, dict] = field(default_factory=dict)  # value key -> {_CELL_KEYS: value}

    @property
    def keys(self) -> list[str]:
        return [value_key(v) for v in self.values]


@dataclass
class SideSpec:
    """One side of the spec as written (``[reference]`` or ``[candidate]``): templates, not yet
    filled in for a cell (that is :class:`SideJob`)."""

    name: str  # "reference" | "candidate"
    label: str
    template: list[str]  # entry argv template: what follows torchrun's own options
    env: dict[str, str]
    flags: dict[str, dict[str, list[str]]]  # per-side override: axis -> value key -> args
    builtin: bool = False


@dataclass
class LauncherSpec:
    type: str = "local"
    options: dict = field(default_factory=dict)  # the slurm keys, validated, as given


@dataclass
class SideJob:
    """One side of one cell with every placeholder filled in (before the launcher wraps it)."""

    side: str
    label: str
    entry_argv: list[str]
    env: dict[str, str]

    def fingerprint(self, spec: "Spec", cell: "Cell") -> str:
        blob = json.dumps({
            "entry_argv": self.entry_argv, "env": self.env, "nnodes": spec.nnodes,
            "nproc_per_node": cell.nproc_per_node, "capture": spec.capture,
            "workdir": str(spec.workdir) if spec.workdir else None,
            **({"emulate_nccl": cell.emulate_nccl} if cell.emulate_nccl else {}),
        }, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class Cell:
    id: str
    axes: dict  # axis name -> value (TOML-typed), in spec order
    requires: list[str]
    sides: dict[str, SideJob]
    # the spec's values, or what one of the cell's axis values sets (``[axes.X.set.V]``)
    nproc_per_node: int = 1
    emulate_nccl: str | None = None
    at: str | None = None
    nnodes: int = 1

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def label(self) -> str:
        return ",".join(f"{k}={value_key(v)}" for k, v in self.axes.items()) or "(no axes)"


@dataclass
class Spec:
    name: str
    description: str
    source: str  # the file it came from ("<string>" when parsed from text)
    text: str  # the TOML text, kept so a sweep directory records exactly what ran
    steps: int
    seed: int
    nproc_per_node: int
    nnodes: int
    timeout: float
    env: dict[str, str]
    workdir: Path | None
    requires: list[str]
    capture: bool
    axes: list[Axis]
    sides: dict[str, SideSpec]
    launcher: LauncherSpec
    # a side that exits non-zero after every rank recorded every step counts as finished (a
    # crash in teardown, e.g. at process-group destruction); off: the exit code is the status
    tolerate_teardown_exit: bool = False
    # issue 20: predict every cell's reduction order at this topology ("8x8"; parity diff --at);
    # several, comma-joined ("1x8,8x8": spec ``at = ["1x8", "8x8"]``), one row each
    at: str | None = None
    # issue 23: run each distinct reference job twice and diff the repeat (parity/sweep/control.py)
    control: bool = False
    # issue 23: stop both jobs K steps after the first divergent step (parity/sweep/early_stop.py)
    stop_after_divergence: int | None = None
    # every job runs under `parity exec --emulate-nccl TOPOLOGY` (docs/nccl-emulation.md)
    emulate_nccl: str | None = None

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def cells(self, steps: int | None = None, sweep_dir: str | os.PathLike | None = None
              ) -> list[Cell]:
        """Every cell of the matrix, in spec order (the first axis varies slowest).

        ``sweep_dir`` fills the ``{run_dir}`` placeholder (``SWEEP_DIR/cells/CELL/SIDE``).
        """
        steps = self.steps if steps is None else steps
        sweep_dir = Path(sweep_dir) if sweep_dir is not None else Path("SWEEP_DIR")
        cells = []
        used_ids: set[str] = set()
        combos = itertools.product(*[a.values for a in self.axes]) if self.axes else [()]
        for combo in combos:
            axes = {a.name: v for a, v in zip(self.axes, combo)}
            cid = cell_id(axes, used_ids)
            used_ids.add(cid)
            requires = list(self.requires)
            for a, v in zip(self.axes, combo):
                for r in a.requires.get(value_key(v), []):
                    if r not in requires:
                        requires.append(r)
            world = self.cell_world(combo)
            sides = {}
            for sname, side in self.sides.items():
                values = {a.name: value_key(v) for a, v in zip(self.axes, combo)}
                values.update(steps=str(steps), seed=str(self.seed),
                              nproc_per_node=str(world["nproc_per_node"]), nnodes=str(self.nnodes),
                              world_size=str(world["nproc_per_node"] * self.nnodes), side=sname,
                              cell=cid, run_dir=str(sweep_dir / CELLS_DIR / cid / sname))
                argv = [substitute(t, values) for t in side.template]
                for a, v in zip(self.axes, combo):
                    table = side.flags.get(a.name, a.flags)
                    argv.extend(substitute(t, values) for t in table.get(value_key(v), []))
                # torchtitan's batch flags in the installed torchtitan's spelling
                argv = torchtitan_args.adapt_for_installed(argv, self.workdir, f"{cid} {sname}: ")
                env = {k: substitute(t, values) for k, t in {**self.env, **side.env}.items()}
                sides[sname] = SideJob(sname, side.label, argv, env)
            cells.append(Cell(cid, axes, requires, sides, nnodes=self.nnodes, **world))
        return cells

    def cell_world(self, combo) -> dict:
        """nproc_per_node, emulate_nccl and at of the cell of axis values ``combo``: the spec's,
        unless one of the values sets them (two values setting one key differently: SpecError)."""
        world = {"nproc_per_node": self.nproc_per_node, "emulate_nccl": self.emulate_nccl,
                 "at": self.at}
        by: dict[str, str] = {}
        for a, v in zip(self.axes, combo):
            for k, val in a.sets.get(value_key(v), {}).items():
                if k in by and world[k] != val:
                    raise SpecError(f"{self.source}: axes.{a.name}.set.{value_key(v)}.{k}: "
                                    f"conflicts with {by[k]} for the same cell")
                world[k] = val
                by[k] = f"axes.{a.name}.set.{value_key(v)}"
        return world

    @property
    def worlds(self) -> list[int]:
        """Every world size a cell of this spec runs at (the spec's first)."""
        out = [self.world_size]
        for a in self.axes:
            for sets in a.sets.values():
                if "nproc_per_node" in sets:
                    w = sets["nproc_per_node"] * self.nnodes
                    if w not in out:
                        out.append(w)
        return out


# ------------------------------------------------------------------------------ ids and filters

_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._+-]")
_MAX_VALUE_LEN = 40


def safe_component(text: str) -> str:
    """A file-name-safe rendering of ``text``: never empty, never '.'/'..', no separators.

    Characters outside ``[A-Za-z0-9._+-]`` become ``_``; when anything had to change, a short
    hash of the original is appended so that distinct values never share a directory.
    """
    safe = _SAFE_CHARS.sub("_", text)
    if safe.startswith("."):
        safe = "_" + safe[1:]
    if len(safe) > _MAX_VALUE_LEN:
        safe = safe[:_MAX_VALUE_LEN]
    if safe != text or not safe:
        safe = f"{safe}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"
    return safe


def cell_id(axes: dict, used: set[str] = frozenset()) -> str:
    """``flash=true,batch_size=4`` with every value made safe (see :func:`safe_component`)."""
    if not axes:
        return "base"
    cid = ",".join(f"{k}={safe_component(value_key(v))}" for k, v in axes.items())
    base, n = cid, 2
    while cid in used:  # only reachable through a hash collision; keep ids unique anyway
        cid = f"{base}~{n}"
        n += 1
    return cid


def _split_escaped(text: str, sep: str) -> list[str]:
    """Split on ``sep`` except where a backslash escapes it; ``\\`` is a backslash. The
    pieces keep other escapes, so a later split on another separator still sees them."""
    out, cur, i = [], [], 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            cur.append(text[i:i + 2])
            i += 2
            continue
        if c == sep:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


def parse_only(only: str | None, spec: Spec) -> dict[str, set[str]]:
    """``'flash=true,batch_size=1|4'`` -> {axis: {value keys}}; unknown axes/values raise.

    A value containing ``,`` or ``|`` (or ``\\``) is written with a backslash before it:
    ``--only 'dims=2\\,4|8'`` selects the values ``2,4`` and ``8``."""
    if not only or not only.strip():
        return {}
    axes = {a.name: a for a in spec.axes}
    out: dict[str, set[str]] = {}
    for part in _split_escaped(only, ","):
        part = part.strip()
        if not part:
            continue
        name, sep, vals = part.partition("=")
        name = name.strip()
        if not sep or not vals.strip():
            raise SpecError(f"--only: {part!r}: expected AXIS=VALUE (e.g. 'flash=true,batch_size=4')")
        if name not in axes:
            known = ", ".join(axes) or "none"
            raise SpecError(f"--only: unknown axis {name!r} (axes of {spec.name}: {known})")
        keys = axes[name].keys
        chosen = out.setdefault(name, set())
        for v in _split_escaped(vals, "|"):
            v = _unescape(v.strip())
            match = [k for k in keys if k == v] or [k for k in keys if k.lower() == v.lower()]
            if not match:
                raise SpecError(f"--only: {name}={v}: not a value of axis {name} "
                                f"(values: {', '.join(keys)})")
            chosen.add(match[0])
    return out


def matches(cell: Cell, only: dict[str, set[str]]) -> bool:
    return all(value_key(cell.axes[name]) in keys for name, keys in only.items())


# ------------------------------------------------------------------------------ substitution


def placeholders(template: str) -> list[str]:
    """Names used as ``{name}`` in ``template`` (``{{`` and ``}}`` are literal braces)."""
    names = []
    for m in _PLACEHOLDER_RE.finditer(template):
        tok = m.group(0)
        if tok in ("{{", "}}"):
            continue
        if m.group(1) is None:
            raise ValueError(f"unmatched {tok!r} in {template!r} (write {tok * 2} for a literal)")
        names.append(m.group(1))
    return names


def substitute(template: str, values: dict[str, str]) -> str:
    def repl(m):
        tok = m.group(0)
        if tok == "{{":
            return "{"
        if tok == "}}":
            return "}"
        return values[m.group(1)]

    return _PLACEHOLDER_RE.sub(repl, template)


# ---------------------------------------------------------------------------------- validation


class _V:
    """Validation helpers that raise one-line SpecErrors naming file and key."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, problem: str):
        raise SpecError(f"{self.source}: {key}: {problem}" if key else f"{self.source}: {problem}")

    def table(self, obj, key: str, known: set[str] | None = None) -> dict:
        if not isinstance(obj, dict):
            self.fail(key, f"must be a table, not {_tname(obj)}")
        if known is not None:
            for k in obj:
                if k not in known:
                    self.fail(_join(key, k), f"unknown key (known: {', '.join(sorted(known))})")
        return obj

    def string(self, obj, key: str, nonempty: bool = True) -> str:
        if not isinstance(obj, str):
            self.fail(key, f"must be a string, not {_tname(obj)}")
        self.no_nul(obj, key)
        if nonempty and not obj.strip():
            self.fail(key, "must not be empty")
        return obj

    def integer(self, obj, key: str, minimum: int | None = None) -> int:
        if isinstance(obj, bool) or not isinstance(obj, int):
            self.fail(key, f"must be an integer, not {_tname(obj)}")
        if minimum is not None and obj < minimum:
            self.fail(key, f"must be >= {minimum}, not {obj}")
        return obj

    def number(self, obj, key: str) -> float:
        if isinstance(obj, bool) or not isinstance(obj, (int, float)):
            self.fail(key, f"must be a number of seconds, not {_tname(obj)}")
        if not obj > 0 or obj != obj or obj == float("inf"):
            self.fail(key, f"must be > 0, not {obj}")
        return float(obj)

    def boolean(self, obj, key: str) -> bool:
        if not isinstance(obj, bool):
            self.fail(key, f"must be true or false, not {_tname(obj)}")
        return obj

    def strings(self, obj, key: str, nonempty: bool = False) -> list[str]:
        if not isinstance(obj, list):
            self.fail(key, f"must be a list of strings, not {_tname(obj)}"
                      + (" (argv is a list, never a shell string)" if isinstance(obj, str) else ""))
        if nonempty and not obj:
            self.fail(key, "must not be empty")
        for i, item in enumerate(obj):
            if not isinstance(item, str):
                self.fail(f"{key}[{i}]", f"must be a string, not {_tname(item)} "
                          f"(quote it: \"{value_key(item) if _scalar(item) else '...'}\")")
            self.no_nul(item, f"{key}[{i}]")
        return list(obj)

    def no_nul(self, s: str, key: str) -> None:
        """A NUL cannot be passed in argv or the environment (exec would fail mid-sweep)."""
        if "\0" in s:
            self.fail(key, "contains a NUL character (not allowed in arguments or environment)")

    def env(self, obj, key: str) -> dict[str, str]:
        self.table(obj, key)
        for k, v in obj.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                self.fail(_join(key, k), "not a valid environment variable name")
            if not isinstance(v, str):
                self.fail(_join(key, k), f"must be a string, not {_tname(v)} (quote it)")
            self.no_nul(v, _join(key, k))
        return dict(obj)

    def templates(self, items: list[str], key: str, known: set[str]) -> None:
        for i, t in enumerate(items):
            self.template(t, f"{key}[{i}]", known)

    def template(self, t: str, key: str, known: set[str]) -> None:
        try:
            names = placeholders(t)
        except ValueError as e:
            self.fail(key, str(e))
        for n in names:
            if n not in known:
                self.fail(key, f"unknown placeholder {{{n}}} in {t!r} "
                          f"(known: {', '.join('{' + k + '}' for k in sorted(known))})")

    def requirement(self, r, key: str) -> str:
        self.string(r, key)
        head, sep, arg = r.partition(":")
        if r in _SIMPLE_REQUIREMENTS:
            return r
        if sep and head in _PREFIX_REQUIREMENTS and arg:
            if head == "gpus" and not arg.isdigit():
                self.fail(key, f"{r!r}: gpus:N needs a whole number")
            if head == "launcher" and arg not in LAUNCHERS:
                self.fail(key, f"{r!r}: launcher must be one of {', '.join(LAUNCHERS)}")
            return r
        self.fail(key, f"unknown requirement {r!r} (known: cuda, gpus:N, module:NAME, "
                       "command:NAME, env:NAME, launcher:local|slurm)")


def _join(key: str, sub) -> str:
    sub = str(sub)
    if not _NAME_RE.match(sub):
        sub = json.dumps(sub)
    return f"{key}.{sub}" if key else sub


def _tname(obj) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
            list: "a list", dict: "a table"}.get(type(obj), type(obj).__name__)


def _scalar(v) -> bool:
    return isinstance(v, (bool, int, float, str))


def _display(path) -> str:
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else str(path)
    except ValueError:
        return str(path)


def load_spec(path: str | os.PathLike | None = None, base_dir: Path | None = None) -> Spec:
    """Read and validate a spec file (the CPU default when ``path`` is None). Relative paths in
    it resolve against ``base_dir`` (default: the spec file's folder)."""
    p = Path(path) if path is not None else default_spec_path()
    source = _display(p)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise SpecError(f"{source}: no such spec file") from None
    except IsADirectoryError:
        raise SpecError(f"{source}: is a directory, not a spec file") from None
    except OSError as e:
        raise SpecError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{source}: not UTF-8 text") from None
    return parse_spec(text, source=source, base_dir=base_dir or p.parent.resolve())


def parse_spec(text: str, source: str = "<string>", base_dir: Path | None = None) -> Spec:
    """Validate a spec's TOML text into a :class:`Spec`: the top-level keys here, then the axes
    (:func:`_parse_axes`), the two sides (:func:`_parse_side`), every template's placeholders
    and the launcher. The first problem raises a SpecError naming file, key and problem."""
    v = _V(source)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        v.fail("", f"invalid TOML: {str(e).splitlines()[0]}")
    v.table(doc, "", _TOP_KEYS)

    name = v.string(doc["name"], "name") if "name" in doc else Path(source).stem
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name):
        v.fail("name", f"{name!r}: use letters, digits, '.', '_' and '-' (it names the output folder)")
    description = v.string(doc.get("description", ""), "description", nonempty=False)
    steps = v.integer(doc.get("steps", 3), "steps", 1)
    seed = v.integer(doc.get("seed", 0), "seed", 0)
    nproc = v.integer(doc.get("nproc_per_node", 2), "nproc_per_node", 1)
    nnodes = v.integer(doc.get("nnodes", 1), "nnodes", 1)
    timeout = v.number(doc.get("timeout", DEFAULT_TIMEOUT), "timeout")
    env = v.env(doc.get("env", {}), "env")
    capture = v.boolean(doc.get("capture", True), "capture")
    tolerate = v.boolean(doc.get("tolerate_teardown_exit", False), "tolerate_teardown_exit")
    emulate = _emulate_nccl(v, doc, nproc * nnodes)
    at = _at(v, doc)
    control = v.boolean(doc.get("control", False), "control")
    stop_after = (v.integer(doc["stop_after_divergence"], "stop_after_divergence", 0)
                  if "stop_after_divergence" in doc else None)
    workdir = None
    if "workdir" in doc:
        wd = Path(os.path.expanduser(v.string(doc["workdir"], "workdir")))
        workdir = wd if wd.is_absolute() else (base_dir or Path.cwd()) / wd
    requires = [v.requirement(r, f"requires[{i}]")
                for i, r in enumerate(v.strings(doc.get("requires", []), "requires"))]

    axes = _parse_axes(v, doc)
    known = set(RESERVED_PLACEHOLDERS) | {a.name for a in axes}
    for axis in axes:
        for vk, items in axis.flags.items():
            v.templates(items, _join(f"axes.{axis.name}.flags", vk), known)

    sides: dict[str, SideSpec] = {}
    axis_by_name = {a.name: a for a in axes}
    for sname in SIDES:
        sides[sname] = _parse_side(v, doc, sname, axis_by_name, known)
    for sname in SIDES:
        for k, t in {**env, **sides[sname].env}.items():
            v.template(t, _join(f"{sname}.env" if k in sides[sname].env else "env", k), known)

    launcher = _launcher(v, doc.get("launcher", "local"), nnodes)
    spec = Spec(name, description, source, text, steps, seed, nproc, nnodes, timeout, env, workdir,
                requires, capture, axes, sides, launcher, tolerate_teardown_exit=tolerate, at=at,
                control=control, stop_after_divergence=stop_after, emulate_nccl=emulate)
    _check_cell_worlds(v, spec)
    return spec


def check_workdir(spec: Spec) -> None:
    """``workdir`` must be an existing directory before any job starts: otherwise every job
    fails on its own, with an OS message that does not name the key (a file: "cannot start
    python: Not a directory"; a missing folder: "command not found"). A spec error (exit 2)."""
    wd = spec.workdir
    if wd is None:
        return
    if not wd.exists():
        problem = "no such directory"
    elif not wd.is_dir():
        problem = "not a directory"
    elif not os.access(wd, os.X_OK):
        problem = "not searchable (permission denied)"
    else:
        return
    raise SpecError(f"{spec.source}: workdir: {wd}: {problem} (the jobs' working directory; "
                    "a relative one is resolved from the spec's folder)")


def _parse_axes(v: _V, doc: dict) -> list[Axis]:
    """The ``[axes]`` table: each axis's values (scalars, distinct, in spec order: the cells'
    order) and its per-value flags and requirements. An axis name is a placeholder, so it must
    be an identifier and not a reserved one."""
    axes: list[Axis] = []
    raw_axes = v.table(doc.get("axes", {}), "axes")
    for aname, adef in raw_axes.items():
        key = _join("axes", aname)
        if not _NAME_RE.match(aname):
            v.fail(key, "axis names are identifiers (letters, digits, '_'; not starting with a digit)")
        if aname in RESERVED_PLACEHOLDERS:
            v.fail(key, f"{aname!r} is a reserved placeholder name; pick another axis name")
        if isinstance(adef, list):
            adef = {"values": adef}
        v.table(adef, key, _AXIS_KEYS)
        if "values" not in adef:
            v.fail(key, "missing 'values'")
        values = adef["values"]
        vkey = f"{key}.values"
        if not isinstance(values, list):
            v.fail(vkey, f"must be a list, not {_tname(values)}")
        if not values:
            v.fail(vkey, "empty axis: give at least one value")
        seen: set[str] = set()
        for i, val in enumerate(values):
            if not _scalar(val):
                v.fail(f"{vkey}[{i}]", f"must be a string, integer, float or boolean, not {_tname(val)}")
            if isinstance(val, str) and not val:
                v.fail(f"{vkey}[{i}]", "must not be an empty string")
            if isinstance(val, str):
                v.no_nul(val, f"{vkey}[{i}]")
            k = value_key(val)
            if k in seen:
                v.fail(f"{vkey}[{i}]", f"duplicate value {k!r}")
            seen.add(k)
        axis = Axis(aname, list(values))
        axis.flags = _value_map(v, adef.get("flags", {}), f"{key}.flags", axis, "flags")
        axis.requires = _value_map(v, adef.get("requires", {}), f"{key}.requires", axis, "requires")
        axis.sets = _axis_sets(v, adef.get("set", {}), f"{key}.set", axis)
        axes.append(axis)
    return axes


def _parse_side(v: _V, doc: dict, sname: str, axis_by_name: dict[str, Axis],
                known: set[str]) -> SideSpec:
    """The ``[reference]`` or ``[candidate]`` table: the built-in workload's ``args`` or a full
    ``argv``, its label, env and per-axis flag overrides (placeholders checked against
    ``known``)."""
    if sname not in doc:
        v.fail(sname, f"missing [{sname}] table (each spec compares a reference and a candidate)")
    sdef = v.table(doc[sname], sname, _SIDE_KEYS)
    builtin = v.boolean(sdef.get("builtin", False), f"{sname}.builtin")
    if builtin:
        if "argv" in sdef:
            v.fail(f"{sname}.argv", "not allowed with builtin = true (put the workload's "
                   "arguments in 'args')")
        args = v.strings(sdef.get("args", []), f"{sname}.args")
        template = BUILTIN_ENTRY + args
        v.templates(args, f"{sname}.args", known)
    else:
        if "args" in sdef:
            v.fail(f"{sname}.args", "only used with builtin = true; give the full entry as "
                   "'argv' (e.g. [\"-m\", \"torchtitan.train\", ...])")
        if "argv" not in sdef:
            v.fail(sname, "missing 'argv' (what follows torchrun's options: "
                   "[\"-m\", \"module\", ...] or [\"script.py\", ...]) or builtin = true")
        template = v.strings(sdef["argv"], f"{sname}.argv", nonempty=True)
        v.templates(template, f"{sname}.argv", known)
    label = v.string(sdef.get("label", sname), f"{sname}.label")
    senv = v.env(sdef.get("env", {}), f"{sname}.env")
    sflags: dict[str, dict[str, list[str]]] = {}
    for aname, table in v.table(sdef.get("flags", {}), f"{sname}.flags").items():
        fkey = _join(f"{sname}.flags", aname)
        if aname not in axis_by_name:
            v.fail(fkey, f"no axis named {aname!r} (axes: {', '.join(axis_by_name) or 'none'})")
        sflags[aname] = _value_map(v, table, fkey, axis_by_name[aname], "flags")
        for vk, items in sflags[aname].items():
            v.templates(items, _join(fkey, vk), known)
    return SideSpec(sname, label, template, senv, sflags, builtin)


def _at(v, doc: dict, key: str = "at") -> str | None:
    """``at = "8x8"`` or ``at = ["1x8", "8x8", "32x8"]`` (or ``"1x8,8x8"``): the topologies every
    cell's diff predicts at (docs/reduction-order.md), checked here; kept as one comma-joined
    string (``parity diff --at`` reads the same)."""
    if "at" not in doc:
        return None
    from parity.diff.reduction import split_topologies

    raw = doc["at"]
    items = raw if isinstance(raw, list) else [v.string(raw, key)]
    specs = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            v.fail(f"{key}[{i}]", f"expected a topology string, got {type(item).__name__}")
        try:
            for spec in split_topologies(item):
                parse_topology(spec)
                specs.append(spec)
        except ParityError as e:
            v.fail(key, str(e))
    if not specs:
        v.fail(key, "no topology given (e.g. \"8x8\" or [\"1x8\", \"8x8\"])")
    return ",".join(specs)


def _axis_sets(v: _V, table, key: str, axis: Axis) -> dict[str, dict]:
    """``[axes.X.set.V]``: the keys of _CELL_KEYS that value V sets for its cells (checked
    against the cell's world in parse_spec)."""
    v.table(table, key)
    out: dict[str, dict] = {}
    for vk, sets in table.items():
        ikey = _join(key, vk)
        if vk not in axis.keys:
            v.fail(ikey, f"{vk!r} is not a value of axis {axis.name} (values: "
                         f"{', '.join(axis.keys)})")
        v.table(sets, ikey, set(_CELL_KEYS))
        got: dict = {}
        for k, val in sets.items():
            if k == "nproc_per_node":
                got[k] = v.integer(val, _join(ikey, k), 1)
            else:
                text = v.string(val, _join(ikey, k), nonempty=False).strip()
                got[k] = text or None  # "" turns the spec's value off
                if text and k == "at":  # several topologies: one row each
                    got[k] = _at(v, {"at": text}, _join(ikey, k))
                elif text:
                    try:
                        topo = parse_topology(text)
                    except Exception as e:  # noqa: BLE001 - its one line names the problem
                        v.fail(_join(ikey, k), str(e))
                    if k == "emulate_nccl":
                        got[k] = topo.spec()
        out[vk] = got
    return out


def _check_cell_worlds(v: _V, spec: "Spec") -> None:
    """Every cell's emulation fits its own world size (NODES x GPUS ranks), and no two axis
    values set one key differently for one cell."""
    combos = itertools.product(*[a.values for a in spec.axes]) if spec.axes else [()]
    for combo in combos:
        world = spec.cell_world(combo)
        emu = world["emulate_nccl"]
        if emu:
            topo = parse_topology(emu)
            ranks = world["nproc_per_node"] * spec.nnodes
            if topo.world != ranks:
                where = ",".join(f"{a.name}={value_key(x)}" for a, x in zip(spec.axes, combo))
                v.fail("emulate_nccl", f"{emu!r} needs {topo.world} ranks (NODES x GPUS); the "
                                       f"cell {where or 'base'} runs {ranks}")
            if not spec.capture:
                v.fail("emulate_nccl", "needs capture = true (parity exec runs the emulation)")


def _emulate_nccl(v: _V, doc: dict, world: int) -> str | None:
    if "emulate_nccl" not in doc:
        return None
    from parity.nccl import parse_topology

    text = v.string(doc["emulate_nccl"], "emulate_nccl")
    try:
        topo = parse_topology(text)
    except Exception as e:  # noqa: BLE001 - its one-line message names the problem
        v.fail("emulate_nccl", str(e))
    if topo.world != world:
        v.fail("emulate_nccl", f"{text!r} needs {topo.world} ranks (NODES x GPUS); the spec "
                               f"runs nproc_per_node x nnodes = {world}")
    if not doc.get("capture", True):
        v.fail("emulate_nccl", "needs capture = true (parity exec runs the emulation)")
    return topo.spec()


def _value_map(v: _V, table, key: str, axis: Axis, what: str) -> dict[str, list[str]]:
    v.table(table, key)
    out = {}
    keys = axis.keys
    for vk, items in table.items():
        ikey = _join(key, vk)
        if vk not in keys:
            v.fail(ikey, f"{vk!r} is not a value of axis {axis.name} (values: {', '.join(keys)})")
        if what == "requires":
            out[vk] = [v.requirement(r, f"{ikey}[{i}]")
                       for i, r in enumerate(v.strings(items, ikey))]
        else:
            out[vk] = v.strings(items, ikey)
    return out


def _launcher(v: _V, obj, nnodes: int) -> LauncherSpec:
    if isinstance(obj, str):
        obj = {"type": obj}
    v.table(obj, "launcher", _LAUNCHER_KEYS)
    ltype = v.string(obj.get("type", "local"), "launcher.type")
    if ltype not in LAUNCHERS:
        v.fail("launcher.type", f"{ltype!r}: must be one of {', '.join(LAUNCHERS)}")
    opts = {}
    for k, typ in _SLURM_KEYS.items():
        if k not in obj:
            continue
        key = f"launcher.{k}"
        val = obj[k]
        if typ is int:
            opts[k] = v.integer(val, key, 0 if k == "gpus_per_node" else 1)
        elif typ is list:
            opts[k] = v.strings(val, key)
        elif typ is str:
            opts[k] = v.string(val, key)
        else:  # time: "HH:MM:SS" / "D-HH:MM:SS" / minutes
            if isinstance(val, str):
                if not re.match(r"^(\d+-)?\d+(:\d{2}){0,2}$", val):
                    v.fail(key, f"{val!r}: use minutes, 'MM:SS', 'HH:MM:SS' or 'D-HH:MM:SS'")
                opts[k] = val
            else:
                opts[k] = v.integer(val, key, 1)
    if "nodes" in opts and opts["nodes"] != nnodes:
        v.fail("launcher.nodes", f"{opts['nodes']} differs from nnodes = {nnodes} (one torchrun "
               "agent per node; leave launcher.nodes out to follow nnodes)")
    return LauncherSpec(ltype, opts)
