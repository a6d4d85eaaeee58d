"""The package's imports point one way: public API -> normalisation / plans -> dispatch -> backends ->
shared helpers (batch, kernels). No import cycle, and no backend imports another backend."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pagedprefill"

# Each module's layer; a module may import only modules of a lower layer (same layer: not at all,
# except within one backend's own package).
LAYERS = {
    "batch": 0,
    "tuning": 0,
    "kernels.launch": 1,
    "kernels.metadata": 2,
    "kernels.merge": 2,
    "kernels": 1,
    "workspace": 3,  # (shared helpers: the device table, the workspace's carving)
    "plan_cache": 3,
    "backends": 5,
    "dispatch": 6,
    "normalise": 7,
    "prefill_plan": 9,
    "merge": 9,
    "api": 10,
    "wrappers": 11,
    "flashinfer": 12,
    "ops": 12,
    "workloads": 13,
    "bench": 14,
    "demo": 14,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """pagedprefill modules imported by ``path`` (absolute and relative, at any depth of the file)."""
    tree = ast.parse(path.read_text())
    mod = _module_name(path)
    package = mod.split(".")[:-1] if path.name != "__init__.py" else mod.split(".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name[len("pagedprefill.") :] for a in node.names if a.name.startswith("pagedprefill.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("pagedprefill"):
                target = node.module[len("pagedprefill") :].lstrip(".")
            else:
                continue
            if not node.module or node.module == "pagedprefill":
                found |= {f"{target}.{a.name}".strip(".") for a in node.names}
            else:
                found.add(target)
    return {f for f in found if f}


def _layer(name: str) -> int:
    if name == "":
        return 11  # the package itself: its public names
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise AssertionError(f"module {name!r} has no layer in LAYERS: give it one")


def _backend_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "backends" and len(parts) > 1 else None


def _package_of(name: str) -> str:
    """The sub-package a module belongs to (its own name for a top-level module)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "backends" else parts[0]


def _graph() -> dict[str, set[str]]:
    paths = list(SRC.rglob("*.py"))
    modules = {_module_name(p) for p in paths}

    def as_module(name: str) -> str:  # "x.y.Name" -> the module it lives in ("" for the package)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    return {_module_name(p): {as_module(i) for i in _imports(p)} - {_module_name(p)} for p in paths}


def test_imports_point_down_the_layers():
    bad = []
    for mod, deps in _graph().items():
        if not mod:
            continue  # the package's __init__ re-exports the public names
        for dep in deps:
            mine, theirs = _backend_of(mod), _backend_of(dep)
            if _package_of(mod) == _package_of(dep):
                continue  # inside one package (a backend's, the benchmark's): the cycle test still applies
            if mine is not None and theirs is not None:
                bad.append(f"{mod} -> {dep} (a backend importing another backend)")
            elif _layer(dep) >= _layer(mod) and not (mine and dep == "backends"):
                bad.append(f"{mod} (layer {_layer(mod)}) -> {dep} (layer {_layer(dep)})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()

    edges = {m: {d for d in deps if d} for m, deps in graph.items() if m}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [m, d]))
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [])


def test_a_backend_is_one_package_and_one_registry_line():
    from pagedprefill import dispatch

    for name, module in dispatch._MODULES.items():
        assert module.startswith("pagedprefill.backends."), module
        assert name in dispatch.BACKENDS


def test_only_dispatch_names_the_backend_modules():
    """Outside the backends' own packages, a backend module is reached through the registry
    (``dispatch.backend_module``), never by its dotted path in a string (``importlib`` or
    ``sys.modules`` lookups that the import graph above cannot see)."""
    named = []
    for path in SRC.rglob("*.py"):
        mod = _module_name(path)
        if mod == "dispatch" or _backend_of(mod) is not None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("pagedprefill.backends"):
                    named.append(f"{mod}: {node.value!r}")
    assert not named, "backend modules named outside dispatch:\n" + "\n".join(named)
