"""The folder layout is the architecture: imports run one way between the layers, never in a circle.

Every import statement between the package's modules counts, at any depth (an import inside a function is
still an edge). Layers, bottom to top; a module may import its own subpackage and any lower layer:

    import_hooks < import_compiles, import_structures < errors, families < config < parallel < data < models, runtime < trainer, launch < outputs, reference
    < recipe < train, testing < cli

``trainer/`` holds the step and the loop; ``outputs/`` what a run leaves (the exported model, its card, the
upload); ``reference/`` the cached reference log-probs; ``recipe/`` the commands' recipes and the setup they share;
``train.py`` the training recipe's public entry.

A module over MAX_MODULE_LINES is a prompt to look at what it holds: split it by responsibility (a part a reader
would look for by name), not by line count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "coati_kto"
LAYERS = {
    "__init__": 0,
    "errors": 0,
    "locks": 0,  # the flock helpers: the data package and the runtime share them
    "import_compiles": -1,  # below the package's __init__, which installs it
    "import_structures": -1,  # the same
    "import_hooks": -2,  # what those two are built on
    "families": 1,
    "config": 2,
    "parallel": 3,
    "data": 4,
    "models": 5,
    "runtime": 5,
    "trainer": 6,
    "launch": 6,
    "outputs": 7,
    "reference": 7,
    "recipe": 8,
    "train": 9,
    "testing": 9,
    "colossalai_launch": 9,
    "cli_args": 9,
    "cli": 10,
    "__main__": 11,
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# A ColossalAI plugin by name: only parallel/ (a backend per plugin) and config/ (what a config may combine) say one.
PLUGIN_NAME = re.compile(
    r"hybrid_parallel|low_level_zero|LowLevelZero|HybridParallel|[Gg]emini|['\"]ddp['\"]"
)
PLUGIN_ROOMS = ("parallel", "config")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _edges() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != module and not module.startswith(target + "."):
                    edges[module].add(target)
    return edges


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else "__init__"
    assert top in LAYERS, (
        f"{module}: no layer for coati_kto.{top} (add it to LAYERS and to docs/architecture.md)"
    )
    return top, LAYERS[top]


def test_every_import_runs_down_the_layers() -> None:
    upward = []
    for module, targets in _edges().items():
        top, layer = _layer(module)
        for target in targets:
            target_top, target_layer = _layer(target)
            if target_top != top and target_layer >= layer:
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_no_import_circles() -> None:
    edges = _edges()
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                pytest.fail("import circle: " + " -> ".join([*path[path.index(target) :], target]))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_functions_stay_short() -> None:
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not long, long


def test_a_long_module_is_split_by_responsibility() -> None:
    """A module past the cap holds more than one concern, or one that grew: find the part a reader would look for
    by name and give it its own module. Moving lines to a sibling to get under the number is not the fix."""
    long = [
        f"{path.relative_to(PACKAGE)}: {lines} lines"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := path.read_text().count("\n")) > MAX_MODULE_LINES
    ]
    assert not long, (
        f"over {MAX_MODULE_LINES} lines: {', '.join(long)}. Split by responsibility, not by line count: name what "
        "each part of the module is for and move the part that stands on its own (docs/architecture.md lists "
        "where each concern lives)."
    )


def test_only_the_parallel_backends_and_the_config_name_a_plugin() -> None:
    """Every other module asks the run's backend (``coati_kto.parallel.backends``) a question instead of comparing
    plugin names, so a new plugin or parallel axis is one backend's concern plus its name in the config."""
    named = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in PLUGIN_ROOMS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PLUGIN_NAME.search(line)
    ]
    assert named == [], "\n".join(named)
