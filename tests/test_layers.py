"""The layer picture of docs/contributing.md, checked on the imports themselves: a module imports
only from its own folder or from layers below it, and no import cycle exists between modules
(imports under TYPE_CHECKING included)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import ferry

SRC = pathlib.Path(ferry.__file__).parent
# lower number = lower layer; a folder (or top-level module) may import only from lower layers
LAYERS = {
    **dict.fromkeys(("device", "errors", "alignment", "layout", "op_names", "node_meta", "capture",
                     "backend_registry", "progress", "imported"), 0),
    "ops": 1, "program": 2, "choices": 3, "aot": 4, "runtime": 4, "seq2seq": 4, "backends": 5,
    **dict.fromkeys(("cli", "cli_generate", "cli_progress", "views", "inspect", "distributed", "examples", "__main__"), 6),
}
TOP = 6  # the front ends may use one another


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ferry"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else str(node.module))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("ferry."))
    return edges


def _folder(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_folder_has_a_layer():
    assert {_folder(m) for m in _modules() if m != "ferry"} <= set(LAYERS)


def test_no_import_runs_up_a_layer_or_across_siblings():
    modules = _modules()
    wrong = []
    for src, targets in _imports(modules).items():
        for dst in targets:
            if "ferry" in (src, dst) or _folder(src) == _folder(dst):
                continue
            a, b = LAYERS[_folder(src)], LAYERS[_folder(dst)]
            if b > a or (a == b and a not in (0, TOP)):
                wrong.append(f"{src} -> {dst}")
    assert wrong == []


def test_no_import_cycle():
    modules = _modules()
    edges = _imports(modules)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if nxt not in modules or nxt == "ferry":
                continue
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for m in sorted(modules):
        if m not in state and m != "ferry":
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("layer", ["ops", "program", "choices"])
def test_the_lower_layers_never_import_the_runtime_or_the_compiler(layer):
    modules = _modules()
    edges = _imports(modules)
    reach = {d for s, ds in edges.items() if _folder(s) == layer for d in ds}
    assert not {d for d in reach if _folder(d) in ("aot", "runtime", "backends", "cli", "views")}
