"""The engine's structure, read from its imports (the source parsed, nothing imported): the scheduler's side of the
wall reaches no worker module, the packages import downward only, and the cache's ledger and the parallel
strategies do not import each other (the placement vocabulary they share is engine/placement.py, a leaf)."""
import ast
import pathlib

from paths import ROOT

PACKAGE = pathlib.Path(ROOT) / "burstserve"

# worker 0's scheduler and what it plans with: built from EngineConfig and WorkerFacts (docs/design.md, "The wall")
SCHEDULER_SIDE = ["scheduler", "step_plan", "step_result", "decode_steps", "preemption", "inbox", "sequences",
                  "stats_publisher", "token_outputs", "dispatch", "chunk_sizer", "cache.kv_manager", "cache.ledger",
                  "cache.page_planner", "cache.prefix_cache"]
# what a worker runs: its runner, attention calls, graphs, its pages, the model and the strategies
WORKER_SIDE = ["worker", "model_runner", "worker_cache", "worker_memory", "extend_attention", "extend_graphs",
               "decode_attention", "decode_graphs", "model", "moe", "weights", "cache.page_pool", "cache.host_pool",
               "parallel"]
LAYERS = ["kernels", "engine", "server", "clients"]          # each imports only those before it


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> its file, for every module of the package (a package by its __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


MODULES = module_files()


def imports_of(module: str) -> set[str]:
    """The package's modules that `module` imports (`from a.b import c` names a.b.c where c is a module, else a.b)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("burstserve"):
            submodules = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("burstserve")}
    return found & MODULES.keys()


def reached_from(modules: list[str]) -> set[str]:
    """Every module the given ones import, directly or through others."""
    seen, todo = set(modules), list(modules)
    while todo:
        for nxt in imports_of(todo.pop()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def engine_module(name: str) -> str:
    return f"burstserve.engine.{name}"


def is_worker_module(module: str) -> bool:
    return any(module == engine_module(w) or module.startswith(engine_module(w) + ".") for w in WORKER_SIDE)


def test_the_lists_name_modules_that_exist():
    for name in SCHEDULER_SIDE + WORKER_SIDE:
        assert engine_module(name) in MODULES, name


def test_the_scheduler_side_never_imports_a_worker_module():
    reached = reached_from([engine_module(m) for m in SCHEDULER_SIDE])
    assert not {m for m in reached if is_worker_module(m)}, sorted(m for m in reached if is_worker_module(m))
    assert not {m for m in reached if m.startswith("burstserve.kernels.") and m != "burstserve.kernels.arith"}


def test_the_import_reader_sees_a_worker_import():
    """The reader is not blind: the worker's entry point reaches the runner, and the runner the strategies."""
    reached = reached_from([engine_module("worker")])
    assert engine_module("model_runner") in reached and engine_module("parallel.ring") in reached


def test_the_packages_import_downward_only():
    for module in MODULES:
        layer = module.split(".")[1] if module.count(".") else None
        if layer not in LAYERS:
            continue
        above = set(LAYERS[LAYERS.index(layer) + 1:])
        bad = {m for m in imports_of(module) if m.split(".")[1] in above}
        assert not bad, (module, sorted(bad))


def test_the_cache_and_the_strategies_do_not_import_each_other():
    for a, b in (("cache", "parallel"), ("parallel", "cache")):
        bad = {(m, t) for m in MODULES if m.startswith(engine_module(a) + ".")
               for t in imports_of(m) if t.startswith(engine_module(b))}
        assert not bad, sorted(bad)
    placement = imports_of(engine_module("placement"))
    assert placement <= {"burstserve.kernels.arith"}, placement          # a leaf


def test_no_class_of_the_engine_is_over_300_lines():
    long = [(name, node.name, node.end_lineno - node.lineno + 1)
            for name, path in MODULES.items() if name.startswith("burstserve.engine")
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            and node.end_lineno - node.lineno + 1 > 300]
    assert not long, long
