"""The package's layers only point down: no module imports from a layer above its own, and no
two packages import each other (docs/DESIGN.md, "Layout"); and nothing in saguaro.models sets
another object's state from outside it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "saguaro"

# Lowest first. A module belongs to the longest prefix listed; it may import from its own layer
# and the layers below.
LAYERS = [
    ["saguaro.datasets", "saguaro.system"],
    ["saguaro.models", "saguaro.config"],  # EngineConfig names the models' defaults, dtypes and modes
    ["saguaro.engine"],
    ["saguaro.speculation"],
    ["saguaro.llm", "saguaro.outputs", "saguaro"],  # the package's face re-exports LLM
    ["saguaro.server", "saguaro.bench", "saguaro.distill"],
    ["saguaro.cli"],
]


def layer_of(module: str) -> tuple[int, str]:
    """(layer, the prefix that placed it)."""
    matches = [(len(prefix), i, prefix) for i, layer in enumerate(LAYERS) for prefix in layer
               if module == prefix or module.startswith(prefix + ".")]
    if not matches:
        raise KeyError(f"{module} is in no layer: add it to LAYERS")
    _, i, prefix = max(matches)
    return i, prefix


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool) -> set[str]:
    """The saguaro modules a module's source imports (anywhere in it, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from saguaro import bench`
    return {name for name in found if name == "saguaro" or name.startswith("saguaro.")}


def package_modules(root: Path) -> dict[str, set[str]]:
    """Module -> the saguaro modules it imports, for every module under root."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        graph[name] = imports(path.read_text(), name, path.name == "__init__.py")
    return graph


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up a layer, and pairs of packages that import each other."""
    known = set(graph)
    found = []
    package_edges = set()
    for module, targets in graph.items():
        layer, prefix = layer_of(module)
        for target in targets:
            if target not in known:  # `from saguaro.x import name`: the name is not a module
                continue
            target_layer, target_prefix = layer_of(target)
            if target_layer > layer:
                found.append(f"{module} (layer {layer}) imports {target} (layer {target_layer})")
            if target_prefix != prefix:
                package_edges.add((prefix, target_prefix))
    for a, b in sorted(package_edges):
        if a < b and (b, a) in package_edges:
            found.append(f"{a} and {b} import each other")
    return found


def test_every_module_has_a_layer():
    for module in package_modules(PACKAGE):
        layer_of(module)


def test_imports_only_point_down():
    assert violations(package_modules(PACKAGE)) == []


def test_the_check_catches_an_upward_import_and_a_cycle(tmp_path):
    """The same check on a copy of the package with two bad imports added."""
    copy = tmp_path / "saguaro"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    runner = copy / "engine" / "runner.py"
    runner.write_text(runner.read_text() + "\nfrom saguaro.speculation.remote.proposer import RemoteProposer\n")
    found = violations(package_modules(copy))
    assert any("saguaro.engine.runner (layer 2) imports saguaro.speculation.remote.proposer" in v for v in found)
    assert any("saguaro.engine and saguaro.speculation import each other" in v for v in found)
    lazy = copy / "models" / "hub.py"
    lazy.write_text(lazy.read_text() + "\n\ndef f():\n    from ..llm import LLM\n")
    assert any("saguaro.models.hub (layer 1) imports saguaro.llm" in v for v in violations(package_modules(copy)))


@pytest.mark.parametrize("module, layer", [("saguaro.speculation.remote.proposer", 3), ("saguaro.llm", 4),
                                           ("saguaro", 4), ("saguaro.config", 1)])
def test_modules_land_in_their_layer(module, layer):
    assert layer_of(module)[0] == layer


# What runs only in the engine's process: the draft worker must load none of it.
ENGINE_SIDE = ("saguaro.llm", "saguaro.engine.loop", "saguaro.engine.decoder", "saguaro.engine.round",
               "saguaro.engine.verifier", "saguaro.speculation.remote", "saguaro.speculation.policy",
               "saguaro.speculation.build", "saguaro.server", "saguaro.bench")


def engine_side_modules_loaded_by(module: str) -> list[str]:
    """The engine-side modules a fresh interpreter holds after importing `module`."""
    code = f"import sys, {module}; print(' '.join(m for m in sys.modules if m.startswith('saguaro')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return sorted(m for m in loaded if any(m == side or m.startswith(side + ".") for side in ENGINE_SIDE))


def test_the_draft_worker_process_loads_nothing_of_the_engine_side():
    assert engine_side_modules_loaded_by("saguaro.speculation.worker.server") == []


def test_the_worker_check_sees_the_engine_side():
    """Control: the engine's SSD client is engine-side, and so is what it imports."""
    assert "saguaro.speculation.remote.client" in engine_side_modules_loaded_by("saguaro.speculation.remote.client")


# Where saguaro.models sets another object's attributes on purpose: (file, the attribute set).
OWN_PARTS = {
    ("models/native/bindings.py", "argtypes"),  # ctypes' way to declare a C signature
    ("models/native/bindings.py", "restype"),
    ("models/tensor_parallel.py", "_timeout"), ("models/tensor_parallel.py", "_devices"),  # torch's option structs take
    ("models/tensor_parallel.py", "rootRank"),  # no constructor arguments
    ("bench/peers.py", "num_assistant_tokens"), ("bench/peers.py", "num_assistant_tokens_schedule"),  # transformers'
    ("bench/peers.py", "assistant_confidence_threshold"),  # assisted generation reads these off the assistant's config
    ("bench/peers.py", "lm_head"), ("bench/peers.py", "weight"),  # the head of the transformers model it builds
    ("server/app.py", "inflight"),  # Starlette's app.state: the framework's place for what the app shares
    ("models/llama.py", "weight"),  # LlamaModel.tie_weights: its head shares its embedding table
    # an object's own record (self.part.x), kept by that object alone
    ("models/graphs.py", "hidden"), ("models/graphs.py", "graph"),  # StepGraphs' captured pass
    ("models/prefix_cache.py", "queries"), ("models/prefix_cache.py", "query_tokens"),  # PrefixCache's counters
    ("models/prefix_cache.py", "hit_tokens"), ("models/prefix_cache.py", "evicted_blocks"),
    ("engine/sequence.py", "cached_tokens"), ("engine/sequence.py", "t_first_token"),  # a Sequence's stats
    ("engine/sequence.py", "t_finish"),
    ("server/scheduler.py", "rejected"), ("server/scheduler.py", "prompt_tokens"),  # the scheduler's stats
    ("server/scheduler.py", "generation_tokens"), ("server/scheduler.py", "rounds"),
    ("server/scheduler.py", "batch_size_sum"),
}


def foreign_assignments(folder: Path) -> set[tuple[str, str]]:
    """(file, attribute) of each assignment to an attribute of anything but `self` itself (so
    `model.x = ...` and `self.part.x = ...` count), and of each setattr on anything but self."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = [t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple)
                                                                   else [target])]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and ast.unparse(node.args[0]) != "self":
                targets = [ast.Attribute(node.args[0], ast.unparse(node.args[1]))]
            else:
                continue
            found |= {(path.relative_to(folder).as_posix(), t.attr) for t in targets if isinstance(t, ast.Attribute)
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")}
    return found


def test_nothing_sets_another_objects_state():
    """An object's state changes in its constructor or its own methods: a model's running state
    (quantization, native layers, tensor parallelism, captured passes, batch invariance) is
    handed to it whole by LlamaModel.use, a sequence records its prefill with Sequence.prefilled,
    the benchmark swaps an LLM's engine with LLM.decoding_with. Nothing in saguaro sets another
    object's attributes but the library structs and own records listed in OWN_PARTS."""
    assert foreign_assignments(PACKAGE) - OWN_PARTS == set()


def test_the_state_check_sees_an_outside_assignment(tmp_path):
    """Control: a loader that sets its model's native layers from outside is caught."""
    (tmp_path / "loader.py").write_text("def load(model, layers):\n    model.native_layers = layers\n")
    assert foreign_assignments(tmp_path) == {("loader.py", "native_layers")}
