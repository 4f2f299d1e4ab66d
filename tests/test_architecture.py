"""The layout's rules, checked on the code as it is: tools -> stages -> plumbing -> core.

Every project module is placed in one layer; an import may point down, or stay inside its own
layer (core to core, plumbing to plumbing, a stage to its own package), but never up and never
from one stage to another. The import graph has no loop, and each Make target that runs a
stage or tool runs the module of its own name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).parent.parent
PACKAGES = ("pipeline", "eval", "release", "model_card")
STAGE_MODULES = {
    "pipeline.verifier": "verifier",
    "pipeline.generate": "generate",
    "pipeline.extract": "extract",
    "pipeline.train": "train",
    "eval": "eval",
    "pipeline.data_curve": "data-curve",
    "pipeline.tune": "tune",
    "release.licenses": "licenses",
    "model_card.card": "card",
    "release.publish": "publish",
}
CORE, PLUMBING, STAGE, TOOL = range(4)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


def layer(module: str) -> tuple[int, str]:
    """(layer, unit): a stage's or tool's unit is itself, so that its own package is one unit."""
    if module.startswith("pipeline.core.") or module in ("pipeline", "pipeline.core"):
        return CORE, "core"
    if module.startswith(("pipeline.serving", "pipeline.training")) or module in (
        "release.license_rules",
    ):
        return PLUMBING, "plumbing"
    if module.startswith("pipeline.tools"):  # each tool is a unit, its own package included
        return TOOL, ".".join(module.split(".")[:3])
    for stage_module, stage in STAGE_MODULES.items():
        if module == stage_module or module.startswith(stage_module + "."):
            return STAGE, stage
    if module in ("release", "model_card"):  # package markers, empty
        return CORE, "core"
    raise AssertionError(f"{module} is in no layer: place it in tests/test_architecture.py")


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from package import submodule` imports the submodule, anything else the module
            names = [
                full if (full := f"{node.module}.{alias.name}") in known else node.module
                for alias in node.names
            ]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(path, known) - {name} for name, path in found.items()}


def test_every_import_points_down_and_no_stage_imports_another():
    wrong = []
    for source, targets in graph().items():
        (src_layer, src_unit) = layer(source)
        for target in targets:
            dst_layer, dst_unit = layer(target)
            if dst_layer > src_layer:
                wrong.append(f"{source} -> {target} (up a layer)")
            elif dst_layer == src_layer == STAGE and dst_unit != src_unit:
                wrong.append(f"{source} -> {target} (stage to stage)")
            elif dst_layer == src_layer == TOOL and dst_unit != src_unit:
                wrong.append(f"{source} -> {target} (tool to tool)")
    assert not wrong, "\n".join(wrong)


def test_the_import_graph_has_no_loop():
    edges = graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = [*path[path.index(node) :], node]
            raise AssertionError("import loop: " + " -> ".join(cycle))
        if node in done:
            return
        for target in sorted(edges.get(node, ())):
            visit(target, [*path, node])
        done.add(node)

    for module in sorted(edges):
        visit(module, [])


def make_recipes() -> dict[str, str]:
    """Each Make target whose recipe runs a project module: target -> module."""
    recipes, target = {}, None
    for line in (REPO / "Makefile").read_text().splitlines():
        if rule := re.match(r"^([a-z][\w-]*):", line):
            target = rule.group(1)
        elif line.startswith("\t") and target and (run := re.search(r"\$\(STAGE\) ([\w.]+)", line)):
            recipes.setdefault(target, run.group(1))
    return recipes


def test_each_make_target_runs_the_module_of_its_name():
    recipes = make_recipes()
    assert set(STAGE_MODULES.values()) | {"plan", "bench", "gpu-smoke"} <= set(recipes)
    for target, module in recipes.items():
        if target == "hero-run":  # the plan check before the stages
            continue
        assert module.rpartition(".")[2] == target.replace("-", "_"), (target, module)
        assert module in STAGE_MODULES or module.startswith("pipeline.tools."), module
