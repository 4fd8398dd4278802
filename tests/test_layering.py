"""The import graph of rlx_core has floors and no circles: a room imports only from its own
floor or below (function-level imports count too), and no modules import each other round."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "rlx_core"
# lowest first; a module sits on the floor of its first path component under rlx_core
FLOORS = [("ir", "version", "cache", "progress"), ("passes",), ("pipeline", "profile", "profiler"),
          ("plugins", "backends"), ("flow", "weights", "runtime"), ("inspection", "bisection", "testing", "serve"),
          ("cli",)]
FLOOR_OF = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def module_name(path: pathlib.Path, top: pathlib.Path) -> str:
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: pathlib.Path, top: pathlib.Path) -> set:
    """Every module of the package `top` that `path` imports, at any depth of the file."""
    mod = module_name(path, top)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    known = {module_name(p, top) for p in top.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known     # `from pkg import module`
            found.update(subs or {base})
    return {m for m in found if m in known and m != mod}


def graph(top: pathlib.Path) -> dict:
    return {module_name(p, top): imports_of(p, top) for p in sorted(top.rglob("*.py"))}


def cycles(g: dict) -> list:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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

    for v in g:
        if v not in index:
            visit(v)
    return out


def floor(mod: str):
    parts = mod.split(".")
    return FLOOR_OF.get(parts[1]) if len(parts) > 1 else None     # rlx_core itself: the top


def test_no_upward_imports_in_core():
    bad = []
    for mod, deps in graph(CORE).items():
        f = floor(mod)
        if f is None:
            continue
        bad += [f"{mod} -> {d}" for d in deps if floor(d) is None or floor(d) > f]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_every_core_room_has_a_floor():
    rooms = {p.stem if p.is_file() else p.name for p in CORE.iterdir()
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert rooms - {"__init__"} <= set(FLOOR_OF), sorted(rooms - {"__init__"} - set(FLOOR_OF))


@pytest.mark.parametrize("top", [CORE] + sorted(p for where in ("plugins", "examples")
                                               for p in (ROOT / where).glob("*/rlx_*")
                                               if (p / "__init__.py").exists()),
                         ids=lambda p: p.name)
def test_no_import_circles(top):
    found = cycles(graph(top))
    assert not found, f"import circles in {top.name}: {found}"


def test_the_checker_sees_circles_and_lazy_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    assert imports_of(pkg / "a.py", pkg) == {"pkg.sub.b"}
    assert cycles(graph(pkg)) == [["pkg.a", "pkg.sub.b"]]
