"""The import graph of ``fbt_megatron`` (read with ``ast``, nothing imported): no cycles, no import from
a lower layer to a higher one, and no module imports an entry point; and no function is longer
than a screen.

The layers, lowest first, are written down once here. A module belongs to the layer of the longest
name in ``LAYERS`` that is it or a package holding it; it may import its own layer and the ones
below.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "fbt_megatron"

LAYERS = [
    ("ground floor: errors, files written whole, the platform, the data", ["common", "data"]),
    ("test infrastructure: the simulated GPU, which the platform loads by name only with FBT_SIMULATED_DEVICE=1",
     ["testing"]),
    ("the model: the paper's idea, its layers, losses, sequence layout, decode modes and FLOPs", ["model"]),
    ("the model spread over ranks: the pass-aware pipeline, data parallelism", ["distributed"]),
    ("the recipe: its sections, flags and fault specs", ["recipe"]),
    ("the optimizers", ["optimizers"]),
    ("the trainer: a run's data, model, step, log, saves and checkpoints, and its callbacks", ["trainer"]),
    ("inference: trained runs, generation, conversion, serving", ["inference"]),
    ("evaluation and launch: lm-eval, tasks, diagnostics; plan, rehearsal, Slurm", ["evaluation", "launch"]),
    ("experiments: studies, grids of training runs through the training command, their tables and plots",
     ["experiments"]),
    ("the commands: fbt_megatron/commands/, and at the package top the shims that python -m names",
     ["commands", "train", "torchrun", "generate", "convert", "slurm", "plan", "diagnostics", "studies"]),
]


def module_names() -> dict:
    """Dotted name (without ``fbt_megatron.``; a package by its own name) → file."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(path: Path, modules: dict) -> set:
    """The project's modules ``path`` imports (anywhere in the file: lazy imports count)."""
    def module_of(dotted: str):
        name = dotted.removeprefix("fbt_megatron").lstrip(".")
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {module_of(a.name) for a in node.names if a.name.startswith("fbt_megatron")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fbt_megatron"):
            for alias in node.names:  # a module (``from fbt_megatron import flags``) or a name in one
                found.add(module_of(f"{node.module}.{alias.name}"))
    return found - {None}


def graph() -> dict:
    modules = module_names()
    return {name: imports(path, modules) - {name, ""} for name, path in modules.items()}


def layer(name: str) -> int:
    """The index in ``LAYERS`` of the longest entry that is ``name`` or a package holding it."""
    matches = [(len(entry), i) for i, (_, entries) in enumerate(LAYERS) for entry in entries
               if name == entry or name.startswith(entry + ".")]
    assert matches, f"fbt_megatron.{name} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return max(matches)[1]


def test_every_module_has_a_layer_and_imports_none_above_it():
    upward = [f"fbt_megatron.{name} ({LAYERS[layer(name)][0].split(':')[0]}) imports fbt_megatron.{dep} "
              f"({LAYERS[layer(dep)][0].split(':')[0]})"
              for name, deps in sorted(graph().items()) if name for dep in sorted(deps) if layer(dep) > layer(name)]
    assert not upward, "\n".join(upward)


def test_the_imports_have_no_cycle():
    edges, state, cycles = graph(), {}, []

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(edges[name]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_an_entry_point():
    """Nothing imports a command (the top floor) or a ``__main__``; a shim at the package top
    (``fbt_megatron.train``, what ``python -m`` names) imports its own command only."""
    entry_points = {name for name in module_names()
                    if (name and layer(name) == len(LAYERS) - 1) or name == "__main__" or name.endswith(".__main__")}
    importers = [f"fbt_megatron.{name} imports fbt_megatron.{dep}"
                 for name, deps in sorted(graph().items()) for dep in sorted(deps & entry_points)
                 if dep != f"commands.{name}"]
    assert not importers, "\n".join(importers)


def test_no_function_is_longer_than_a_screen():
    """Every function in the package reads on one screen: at most 80 lines, docstring included."""
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, "\n".join(long)
