"""Who may import whom: docs/design.md's room table, read from the docs and enforced row by row
on the source; no cycles, and no hybrid2d import hidden inside a function or behind importlib."""

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybrid2d"
DESIGN = PACKAGE.parent / "docs" / "design.md"


def room_table() -> list[tuple[list[str], set[str] | None]]:
    """(rooms of hybrid2d, rooms they may import, None for "the rooms above") per row of the
    table, bottom up. A name `x.py` or `x/` is a room when hybrid2d has that module or package
    (`recipes/` and `tools/` are the repository's entry points, not rooms)."""
    text = DESIGN.read_text()
    section = text[text.index("## Rooms and who may import whom") :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([\w./]+)`", cells[0])
        rooms = [
            n.removesuffix(".py").removesuffix("/")
            for n in names
            if (n.endswith(".py") and (PACKAGE / n).is_file())
            or (n.endswith("/") and (PACKAGE / n).is_dir())
        ]
        allowed = cells[2]
        may = None if allowed == "the rooms above" else set(re.findall(r"`(\w+)`", allowed))
        if allowed not in ("nothing", "the rooms above", "everything") and not may:
            raise AssertionError(f"design.md: cannot read the last column of {line!r}")
        if rooms:
            rows.append((rooms, may))
    return rows


def allowed_imports() -> dict[str, set[str]]:
    """room -> the rooms it may import, from the table."""
    out: dict[str, set[str]] = {}
    below: set[str] = set()
    for rooms, may in room_table():
        below |= set(rooms)
        for r in rooms:
            out[r] = set(below) if may is None else may
    return out


ALLOWED = allowed_imports()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    """hybrid2d.parallel.fsdp -> parallel; hybrid2d.trainer -> trainer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


IMPORT_CALLS = ("import_module", "__import__", "run_module", "spec_from_file_location")


def hybrid2d_imports(path: Path) -> list[tuple[str, bool]]:
    """(imported hybrid2d module, inside a function?) for every import of a hybrid2d module,
    `importlib.import_module("hybrid2d.x")` and its kind included; a load whose module name is
    computed is reported as "<computed name>", which no room may import."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names if a.name.startswith("hybrid2d")]
                found.extend((name, in_function) for name in names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module.startswith("hybrid2d"):
                    # `from hybrid2d.parallel import shm_comm` imports a module too
                    for a in child.names:
                        candidate = f"{child.module}.{a.name}"
                        is_module = (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(
                            ".py"
                        ).exists() or (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                        found.append((candidate if is_module else child.module, in_function))
            elif isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in IMPORT_CALLS and child.args:
                    arg = child.args[0]
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        if arg.value.startswith("hybrid2d"):
                            found.append((arg.value.split(":")[0], in_function))
                    else:
                        found.append(("<computed name>", in_function))
            visit(child, nested)

    visit(tree, False)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: hybrid2d_imports(p) for m, p in MODULES.items()}


def test_every_module_belongs_to_a_row_of_the_table():
    homeless = sorted({room(m) for m in MODULES if room(m) and room(m) not in ALLOWED})
    assert not homeless, f"rooms missing from docs/design.md's table: {homeless}"


def test_rooms_import_only_what_they_may():
    bad = []
    for module, imports in GRAPH.items():
        if not room(module):
            continue  # hybrid2d/__init__.py
        allowed = ALLOWED.get(room(module), set())
        for target, _ in imports:
            target_room = room(target) if target.startswith("hybrid2d") else target
            if target_room != room(module) and target_room not in allowed:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)


def test_the_table_is_read_and_a_hidden_import_counts():
    """The table's rows came through (a few that must hold), and an importlib load is seen."""
    assert ALLOWED["errors"] == set() and ALLOWED["config"] == {"errors"}
    assert "trainer" in ALLOWED["simulate"] and "trainer" not in ALLOWED["planner"]
    assert "recipes" in ALLOWED  # hybrid2d/recipes.py, the registry (not the recipes/ folder)
    source = PACKAGE.parent / "tests" / "_hidden_import_probe.py"
    try:
        source.write_text(
            "import importlib\n"
            "x = importlib.import_module('hybrid2d.trainer')\n"
            "def f(name):\n    return importlib.import_module(name)\n"
        )
        assert hybrid2d_imports(source) == [("hybrid2d.trainer", False), ("<computed name>", True)]
    finally:
        source.unlink()


def test_only_mesh_names_the_transport():
    """The transport is chosen once, in mesh.py: no other room imports the shared-memory backend
    (counting collectives recognises its ops without it, comm_report.py)."""
    naming = sorted(
        f"{m} imports {t}"
        for m, imports in GRAPH.items()
        for t, _ in imports
        if room(t) == "shm_backend" and room(m) not in ("shm_backend", "mesh")
    )
    assert not naming, "\n".join(naming)


def test_predictions_read_no_measurement():
    """The planner owns every prediction (memory, collectives, step time); profiling/ and
    comm_report.py measure a run and compare with it, so the planner imports neither."""
    reading = sorted(
        f"{m} imports {t}"
        for m, imports in GRAPH.items()
        for t, _ in imports
        if room(m) == "planner" and room(t) in ("profiling", "comm_report")
    )
    assert not reading, "\n".join(reading)


def test_no_hybrid2d_import_inside_a_function():
    hidden = [f"{m} imports {t} inside a function" for m, i in GRAPH.items() for t, f in i if f]
    assert not hidden, "\n".join(hidden)


def test_no_import_cycles():
    def with_packages(target):  # importing a.b.c runs a/b/__init__.py first
        parts = target.split(".")
        return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}

    edges = {
        m: {t for target, _ in imports for t in with_packages(target) if t in MODULES and t != m}
        for m, imports in GRAPH.items()
    }
    # A package's __init__ importing its own submodules is how packages work, not a cycle.
    for m in edges:
        edges[m] = {t for t in edges[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}
    cycles = []

    def walk(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt, stack + [nxt])
        state[node] = 2

    for m in sorted(edges):
        if m not in state:
            walk(m, [m])
    assert not cycles, "\n".join(cycles)


def test_only_the_command_line_imports_tyro():
    """tyro is the command line's parser (cli.py); a room that reads settings must not load it."""
    users = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "tyro" or n.startswith("tyro.") for n in names):
                users.append(module)
    assert sorted(set(users)) == ["hybrid2d.cli"], users


def test_the_model_the_shm_backend_and_the_data_load_without_tyro():
    """config.py imported tyro at module level, so each of these did (and with it tyro's
    docstring_parser)."""
    code = (
        "import sys, hybrid2d.models, hybrid2d.shm_backend, hybrid2d.data, hybrid2d.config;"
        "print(sorted(m for m in sys.modules if m == 'tyro' or m.startswith('tyro.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "[]", out.stdout
