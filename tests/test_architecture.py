"""The folder tree is the architecture diagram: imports only point down the layers, and no module
imports itself back through another (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Lower layers never import higher ones. Packages on one layer do not import each other.
LAYERS = [
    {"config", "cpus", "heap", "sampling_params", "outputs", "health"},
    {"transport", "model", "text", "checkpoints", "prefix_cache"},
    {"kv_transfer", "structured"},
    {"worker"},
    {"engine"},
    {"http"},
    {"server", "proxy"},
    {"llm", "launcher"},
    {"bench", "cluster"},
    {"cli", "pdserve"},  # `pdserve` is the package's own __init__
]


def module_imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in (SRC / "pdserve").rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdserve"):
                edges[module].add(node.module)
            elif isinstance(node, ast.Import):
                edges[module].update(a.name for a in node.names if a.name.startswith("pdserve"))
    return edges


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pdserve"


def layer(pkg: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if pkg in names)


def test_every_package_has_a_layer():
    for path in (SRC / "pdserve").iterdir():
        if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists()):
            name = path.stem if path.suffix == ".py" else path.name
            if name != "__init__":
                layer(name)  # raises StopIteration for a package nobody placed


def test_imports_only_point_down():
    upward = [f"{a} -> {b}" for a, targets in module_imports().items() for b in targets
              if package(a) != package(b) and layer(package(b)) >= layer(package(a))]
    assert not upward, "imports that do not point to a lower layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = module_imports()
    resolved = {m: {t for t in ts if t in edges or t.rsplit(".", 1)[0] in edges} for m, ts in edges.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in resolved.get(m, ()):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in list(resolved):
        if m not in state:
            visit(m, [m])


def test_kv_transfer_knows_neither_engine_nor_worker_and_the_proxy_not_the_server():
    edges = module_imports()
    for a, targets in edges.items():
        for b in targets:
            if package(a) == "kv_transfer":
                assert package(b) not in ("engine", "worker", "server"), f"{a} -> {b}"
            if package(a) == "proxy":
                assert package(b) != "server", f"{a} -> {b}"
            if package(a) == "transport":
                assert package(b) == "transport", f"{a} -> {b}"  # NIXL and its fake stand alone
