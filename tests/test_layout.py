"""The package's layering, read from its imports (ast: module-level and function-level alike).

Layers, bottom to top; a module may import its own layer and the ones below, never above:

    base      parity, errors, text, records,    what every other layer reads: the error type,
              artifacts, rundir, params_codec   text helpers, the artifact schema and layout
    capture   parity.capture.*                  runs inside the ranks (and `parity exec`)
    diff      policy, parity.diff.*             two runs -> a result; the fail-on policy
    sweep     parity.sweep.*                    spec -> cells -> launchers -> per-cell diffs
    probe     parity.probe.*                    parity nccl-probe: the model against a cluster
    bisect    bisect                            reruns a pair with op capture (uses sweep state)
    report    parity.report.*                   renders diffs and sweeps; computes no verdicts
    cli       cli, __main__                     parse, call the library, print, exit codes

Apart: ``parity.workloads`` (the built-in trainer) and ``parity.integrations`` (torchtitan
configs) are users of parity like any other trainer: they import nothing from parity and parity
imports nothing from them. Within a layer, imports may go any way but round (no cycle anywhere).
"""

from __future__ import annotations

import ast
from pathlib import Path

import parity

ROOT = Path(parity.__file__).parent

LAYERS = [
    ("base", ("parity", "parity.errors", "parity.text", "parity.records", "parity.artifacts",
              "parity.rundir", "parity.nccl", "parity.consequences",
              "parity.params_codec", "parity.opt_changes", "parity.comm_ops", "parity.pidlock")),
    ("capture", ("parity.capture",)),
    ("diff", ("parity.policy", "parity.diff")),
    ("sweep", ("parity.sweep",)),
    ("probe", ("parity.probe",)),
    ("bisect", ("parity.bisect",)),
    ("report", ("parity.report",)),
    ("cli", ("parity.cli", "parity.__main__")),
]
APART = ("parity.workloads", "parity.integrations")


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ("parity",) + p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def _layer(mod: str) -> int | None:
    """Index in LAYERS (None: apart). The longest matching prefix wins (``parity`` is base but
    ``parity.capture.x`` is capture)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for pre in prefixes:
            exact_only = pre == "parity"  # the package itself, not everything under it
            hit = mod == pre if exact_only else _under(mod, pre)
            if hit and len(pre) > best_len:
                best, best_len = i, len(pre)
    return best


def _imports(mod: str, path: Path) -> set[str]:
    """parity modules ``mod`` imports, anywhere in its body (a lazy import is still a
    dependency). ``from pkg import name`` is ``pkg.name`` when that is a module, else ``pkg``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                sub = f"{target}.{a.name}"
                found.add(sub if sub in MODULES else target)
    return {m for m in found if _under(m, "parity") and m != mod}


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_place():
    placeless = [m for m in MODULES
                 if _layer(m) is None and not any(_under(m, a) for a in APART)]
    assert not placeless, f"add these modules to a layer in tests/test_layout.py: {placeless}"


def test_no_upward_import():
    bad = []
    for m, deps in GRAPH.items():
        lm = _layer(m)
        if lm is None:
            continue
        for d in deps:
            ld = _layer(d)
            if ld is not None and ld > lm:
                bad.append(f"{m} ({LAYERS[lm][0]}) imports {d} ({LAYERS[ld][0]})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_apart_packages_are_apart():
    bad = []
    for m, deps in GRAPH.items():
        m_apart = next((a for a in APART if _under(m, a)), None)
        for d in deps:
            d_apart = next((a for a in APART if _under(d, a)), None)
            if m_apart and d_apart != m_apart:
                bad.append(f"{m} imports {d}")
            if d_apart and not m_apart:
                bad.append(f"{m} imports {d}")
    assert not bad, "\n".join(sorted(bad))


def _cycles() -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    """The checks above are only as good as the walk: a function-level import counts."""
    src = ("def f():\n    from parity.sweep import state\n"
           "import parity.errors\nfrom . import policy\n")
    p = tmp_path / "m.py"
    p.write_text(src)
    assert _imports("parity.diff", p) == {"parity.sweep.state", "parity.errors", "parity.policy"}
