"""No import circle among mok_proto's modules, counting the imports inside functions too (read with
ast, nothing imported). `from a.b import c` depends on the module a.b.c when there is one, else on
a.b; the packages a module's import runs on the way (a, a/__init__) are not counted as its imports."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "mok_proto"


def _modules() -> dict:
    """{module name: its file} of every module of the package."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set:
    """The package's modules that `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a module: itself; of a name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def find_cycle(graph: dict) -> list | None:
    """One import circle of graph {module: modules it imports} as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_in_the_package():
    modules = _modules()
    assert f"{PACKAGE}.sim.params" in modules and f"{PACKAGE}.results.timelines" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert f"{PACKAGE}.sim.layer" in graph[f"{PACKAGE}.sim.calibrate"]  # imports inside functions count too
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_names_a_circle_through_a_function_import(tmp_path):
    # a circle that only an import inside a function closes (as sim/params.py's h200() once did)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "params.py").write_text("def h200():\n    from pkg import layer\n    return layer\n")
    (pkg / "layer.py").write_text("from pkg.params import h200\n")
    (pkg / "model.py").write_text("from . import params\nimport numpy\n")
    modules = {"pkg": pkg / "__init__.py", **{f"pkg.{m}": pkg / f"{m}.py" for m in ("params", "layer", "model")}}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["pkg.model"] == {"pkg.params"} and graph["pkg.params"] == {"pkg.layer"}
    assert find_cycle(graph) == ["pkg.layer", "pkg.params", "pkg.layer"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
