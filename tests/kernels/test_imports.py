"""kernels/ has no import loop: the modules, read as text (imports at the top and inside functions alike), form
a graph without a cycle, so any of them can be imported first."""
import ast
import os

KERNELS = os.path.join(os.path.dirname(__file__), "..", "..", "burstserve", "kernels")


def kernel_imports() -> dict[str, set[str]]:
    """module name -> the kernels modules it imports."""
    names = {f[:-3] for f in os.listdir(KERNELS) if f.endswith(".py") and f != "__init__.py"}
    graph = {}
    for name in names:
        with open(os.path.join(KERNELS, name + ".py")) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "burstserve.kernels":
                found |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("burstserve.kernels."):
                found.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("burstserve.kernels.")}
        graph[name] = found - {name}
    return graph


def a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a path of module names, or None."""
    state: dict[str, int] = {}               # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state:
                loop = visit(nxt, path + [node])
                if loop:
                    return loop
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            loop = visit(start, [])
            if loop:
                return loop
    return None


def test_the_kernels_modules_import_one_another_without_a_loop():
    graph = kernel_imports()
    assert {"attention", "fp8", "kv_quant", "paged_attention", "device"} <= graph.keys()
    assert graph["device"] == set(), "kernels/device.py is a leaf"
    assert a_cycle(graph) is None, " -> ".join(a_cycle(graph))


def test_a_loop_is_found_where_there_is_one():
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
