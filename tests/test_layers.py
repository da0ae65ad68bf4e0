"""The layer order of docs/architecture.md, derived from the imports and enforced.

Every ``tiersync`` import of every module under ``src/tiersync`` (module level and inside
functions alike) is read with ``ast``; a package may import only itself and the packages of
lower layers. And no import circle among modules' top-level imports (what runs at import time).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tiersync"
# lowest first; a package may import the packages of strictly lower layers (and itself)
LAYERS = [
    {"errors", "telemetry", "settings", "sizes", "iov", "completion", "__init__"},
    {"layout"},
    {"tiers"},
    {"transfer"},
    {"store"},
    {"net"},
    {"disagg", "weights"},
    {"integrations", "bench", "demo"},
    {"cli_servers", "cli_shm", "cli_tls"},
    {"cli_store_node", "cli_router"},
    {"cli"},
    {"__main__"},
]
LEAVES_MAY_IMPORT = {"errors"}  # the leaves import nothing of tiersync but errors


def _module(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("tiersync"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # "from pkg import module"
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("tiersync"))
    return out


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in SRC.rglob("*.py")}


def test_every_package_is_in_a_layer():
    packages = {_package(m) for m in _modules()}
    placed = set().union(*LAYERS)
    assert packages <= placed, f"add to LAYERS (and docs/architecture.md): {sorted(packages - placed)}"


def test_no_package_imports_a_higher_layer():
    rank = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
    modules, wrong = _modules(), []
    for module, path in modules.items():
        mine = _package(module)
        for target in _imports(path, top_level_only=False) & modules.keys():
            theirs = _package(target)
            if theirs == mine:
                continue
            if theirs not in LEAVES_MAY_IMPORT if rank[mine] == 0 else rank[theirs] >= rank[mine]:
                wrong.append(f"{module} (layer {rank[mine]}) imports {target} (layer {rank[theirs]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_circle_at_import_time():
    modules = _modules()
    graph = {m: {t for t in _imports(p, top_level_only=True) if t in modules and t != m} for m, p in modules.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_module_over_400_lines_and_no_function_over_60():
    """The house limits (one idea per module, per function), checked as ruff formats the code."""
    long_modules, long_functions = [], []
    for module, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long_modules.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_modules and not long_functions, "\n".join(long_modules + long_functions)
