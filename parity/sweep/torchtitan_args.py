"""torchtitan's batch flags in the spelling the installed torchtitan understands, and a dry-run
check of every generated command with torchtitan's own parser.

Why: torchtitan 0.3.0 sizes a micro-batch with ``--training.local_batch_size B
--training.seq_len S``; torchtitan main renamed these to
``--training.num_tokens_per_microbatch_per_dp_rank T`` (T = B x S) and
``--training.max_context_length S`` and rejects the old names. A spec is written once and
run against whichever torchtitan is installed, so at sweep time the installed torchtitan's
training-config fields are read and each torchtitan command's batch flags are rewritten into
the spelling it has (either spelling may be written in the spec).

The fields are read without importing torchtitan (which imports torch and triton): the
package is located with ``importlib.util.find_spec`` (the spec's ``workdir`` first, as the job
would run from there) and its ``config`` sources are scanned with ``ast`` for the class that
declares the batch fields. ``check_command`` (``parity sweep --dry-run``) does import
torchtitan and parses the arguments with its ``ConfigManager``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from parity.errors import SpecError

OLD = ("local_batch_size", "seq_len")  # torchtitan 0.3.0
NEW = ("num_tokens_per_microbatch_per_dp_rank", "max_context_length")  # torchtitan main


@dataclass(frozen=True)
class Installed:
    """What was found: the spelling (``"old"``, ``"new"`` or None when unknown) and where."""

    spelling: str | None
    where: str  # the package folder, or why nothing was found

    def describe(self) -> str:
        if self.spelling == "old":
            return (f"torchtitan at {self.where}: batch flags --training.local_batch_size / "
                    "--training.seq_len (0.3.0 spelling)")
        if self.spelling == "new":
            return (f"torchtitan at {self.where}: batch flags "
                    "--training.num_tokens_per_microbatch_per_dp_rank / "
                    "--training.max_context_length (main spelling)")
        return f"torchtitan batch flags left as written: {self.where}"


def spelling_from_fields(fields) -> str | None:
    """``"new"`` when the training config has main's fields, ``"old"`` when it has 0.3.0's,
    None otherwise. ``fields``: names of the training config's fields."""
    names = set(fields)
    if NEW[0] in names and OLD[0] not in names:
        return "new"
    if OLD[0] in names and NEW[0] not in names:
        return "old"
    return None


def class_fields(source: str) -> list[set[str]]:
    """Field names of every class in a Python source (annotated class attributes)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            names = {st.target.id for st in node.body
                     if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
            if names:
                out.append(names)
    return out


def _package_dir(workdir: Path | None) -> Path | None:
    added = False
    if workdir is not None and (Path(workdir) / "torchtitan" / "__init__.py").is_file():
        sys.path.insert(0, str(workdir))
        added = True
    try:
        spec = importlib.util.find_spec("torchtitan")
    except (ImportError, ValueError):
        spec = None
    finally:
        if added:
            sys.path.remove(str(workdir))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


_CACHE: dict[str, Installed] = {}


def installed(workdir: Path | None = None) -> Installed:
    """The installed torchtitan's batch-flag spelling (cached per workdir)."""
    key = str(workdir)
    if key in _CACHE:
        return _CACHE[key]
    pkg = _package_dir(workdir)
    if pkg is None:
        found = Installed(None, "torchtitan is not installed")
    else:
        spelling = None
        config = pkg / "config"
        files = sorted(config.rglob("*.py")) if config.is_dir() else []
        files += sorted(p for p in pkg.glob("*.py"))
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError:
                continue
            if OLD[0] not in text and NEW[0] not in text:
                continue
            try:
                classes = class_fields(text)
            except SyntaxError:
                continue
            for names in classes:
                spelling = spelling_from_fields(names)
                if spelling:
                    break
            if spelling:
                break
        found = Installed(spelling, str(pkg) if spelling else
                          f"no training config with {OLD[0]} or {NEW[0]} found under {pkg}")
    _CACHE[key] = found
    return found


def is_torchtitan(argv: list[str]) -> bool:
    """A command that runs torchtitan: ``-m torchtitan...``, a script path naming torchtitan,
    or any command carrying torchtitan's batch flags."""
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1].startswith("torchtitan"):
        return True
    return any(_flag_name(a) is not None for a in argv)


def _flag_name(arg: str) -> str | None:
    if not arg.startswith("--training."):
        return None
    name = arg.split("=", 1)[0][len("--training."):].replace("-", "_")
    return name if name in OLD + NEW else None


def adapt(argv: list[str], spelling: str | None, where: str = "") -> list[str]:
    """``argv`` with its batch flags in ``spelling`` (``"old"``/``"new"``; None: unchanged).

    Both ``--flag VALUE`` and ``--flag=VALUE``, ``_`` or ``-`` in names. Raises SpecError (one
    line, ``where`` in front) when a translation needs a value the command does not give."""
    if spelling is None:
        return list(argv)
    found: dict[str, tuple[int, int, str]] = {}  # name -> (index, n args, value)
    i = 0
    while i < len(argv):
        name = _flag_name(argv[i])
        if name is not None:
            if "=" in argv[i]:
                found[name] = (i, 1, argv[i].split("=", 1)[1])
            elif i + 1 < len(argv):
                found[name] = (i, 2, argv[i + 1])
                i += 1
        i += 1
    want, other = (NEW, OLD) if spelling == "new" else (OLD, NEW)
    if not any(n in found for n in other):
        return list(argv)
    values = {n: v for n, (_, _, v) in found.items()}

    def num(name: str) -> int:
        try:
            return int(values[name])
        except ValueError:
            raise SpecError(f"{where}--training.{name} {values[name]!r}: not a whole number") from None

    if spelling == "new":
        if OLD[0] in values and OLD[1] not in values and NEW[1] not in values:
            raise SpecError(f"{where}--training.{OLD[0]} without --training.{OLD[1]}: the "
                            f"installed torchtitan needs --training.{NEW[0]} = batch x seq_len")
        seq = num(OLD[1]) if OLD[1] in values else num(NEW[1])
        new_vals = {NEW[1]: str(seq)}
        if OLD[0] in values:
            new_vals[NEW[0]] = str(num(OLD[0]) * seq)
    else:
        if NEW[0] in values and NEW[1] not in values and OLD[1] not in values:
            raise SpecError(f"{where}--training.{NEW[0]} without --training.{NEW[1]}: the "
                            f"installed torchtitan needs --training.{OLD[0]} = tokens / seq_len")
        seq = num(NEW[1]) if NEW[1] in values else num(OLD[1])
        new_vals = {OLD[1]: str(seq)}
        if NEW[0] in values:
            tokens = num(NEW[0])
            if seq <= 0 or tokens % seq:
                raise SpecError(f"{where}--training.{NEW[0]} {tokens} is not a multiple of "
                                f"the context length {seq}: no --training.{OLD[0]} for the "
                                "installed torchtitan")
            new_vals[OLD[0]] = str(tokens // seq)
    # rebuild: the first translated flag goes where the first batch flag was
    drop = {j for n, (idx, k, _) in found.items() if n in other for j in range(idx, idx + k)}
    first = min(found[n][0] for n in other if n in found)
    out: list[str] = []
    for j, a in enumerate(argv):
        if j == first:
            for n in want:
                if n in new_vals and n not in values:
                    out += [f"--training.{n}", new_vals[n]]
        if j not in drop:
            out.append(a)
    return out


def adapt_for_installed(argv: list[str], workdir: Path | None, where: str = "") -> list[str]:
    """``adapt`` with the installed torchtitan's spelling, for torchtitan commands only."""
    if not is_torchtitan(argv):
        return list(argv)
    return adapt(argv, installed(workdir).spelling, where)


# ------------------------------------------------------------------------ dry-run parsing


def _args_after_entry(argv: list[str]) -> list[str]:
    """What follows ``-m MODULE`` or the script path: the trainer's own arguments."""
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 2:]
    for j, a in enumerate(argv):
        if not a.startswith("-"):
            return argv[j + 1:]
    return list(argv)


class Checker:
    """Parses torchtitan commands with torchtitan's own ``ConfigManager`` (``parity sweep
    --dry-run``). ``available`` False (and ``reason``) when torchtitan cannot be imported."""

    def __init__(self, workdir: Path | None = None):
        self.workdir = workdir
        self.reason = ""
        self.ok = self.failed = 0
        self._manager = None
        added = False
        if workdir is not None and (Path(workdir) / "torchtitan" / "__init__.py").is_file():
            sys.path.insert(0, str(workdir))
            added = True
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                from torchtitan.config import ConfigManager  # noqa: PLC0415
            self._manager = ConfigManager
        except BaseException as e:  # noqa: BLE001 - any import failure: not checked, say why
            self.reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            if added and str(workdir) in sys.path:
                sys.path.remove(str(workdir))

    @property
    def available(self) -> bool:
        return self._manager is not None

    def check(self, argv: list[str]) -> str | None:
        """None when torchtitan's parser accepts the command, else one line saying why."""
        if self._manager is None or not is_torchtitan(argv):
            return None
        args = _args_after_entry(argv)
        err = io.StringIO()
        cwd = os.getcwd()
        try:
            if self.workdir is not None and Path(self.workdir).is_dir():
                os.chdir(self.workdir)
            with _gpu_checks_assumed(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(err):
                self._manager().parse_args(args)
        except SystemExit as e:
            self.failed += 1
            lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
            useful = [ln for ln in lines if "nrecognized" in ln or "rror" in ln] or lines
            return _one_line(useful[-1] if useful else f"parser exited with {e.code}")
        except BaseException as e:  # noqa: BLE001
            self.failed += 1
            return _one_line(f"{type(e).__name__}: {e}")
        finally:
            os.chdir(cwd)
        self.ok += 1
        return None

    def summary(self) -> str:
        if not self.available:
            return f"torchtitan commands not checked: torchtitan is not importable ({self.reason})"
        return (f"torchtitan commands parsed with torchtitan's ConfigManager: {self.ok} accepted, "
                f"{self.failed} rejected (GPU-capability checks in config functions assumed met)")


@contextlib.contextmanager
def _gpu_checks_assumed():
    """Config functions such as flex_flash check for an SM90+ GPU while building the config: a
    dry run on a login node checks the command, not the hardware."""
    try:
        import torchtitan.tools.utils as tt_utils  # noqa: PLC0415
    except Exception:  # noqa: BLE001
        yield
        return
    orig = getattr(tt_utils, "has_cuda_capability", None)
    if orig is None:
        yield
        return
    tt_utils.has_cuda_capability = lambda *a, **k: True
    try:
        yield
    finally:
        tt_utils.has_cuda_capability = orig


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def dry_run_checker(spec, cells, selected, write) -> Checker | None:
    """For ``parity sweep --dry-run``: None when no selected command runs torchtitan; else a
    Checker (its availability said in one line up front, with the spelling picked)."""
    argvs = [s.entry_argv for c in cells if c.id in selected for s in c.sides.values()]
    if not any(is_torchtitan(a) for a in argvs):
        return None
    write(installed(spec.workdir).describe() + "\n")
    checker = Checker(spec.workdir)
    if not checker.available:
        write(checker.summary() + "\n")
    return checker
