"""The package's layers: the engine and the data sources import neither Lightning nor the recipes, and no module
imports in a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ompmoe"
INSTALLED_AS = {"callbacks": "ompmoe.callbacks", "eval": "ompmoe.eval"}
"""Top-level directories installed as subpackages of ompmoe (pyproject's package-dir)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in INSTALLED_AS:
        parts[:1] = INSTALLED_AS[parts[0]].split(".")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*directories: str) -> list[Path]:
    return sorted(path for directory in directories for path in (ROOT / directory).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports, at any depth (function-level and ``if TYPE_CHECKING:`` imports count too: a reader
    follows a type to its module as the interpreter follows an import), as absolute names."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("layer", ["engine", "data"])
def test_the_engine_and_the_data_sources_import_neither_lightning_nor_the_recipes(layer):
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        bad = sorted(name for name in _imports(path)
                     if name.split(".")[0] == "lightning" or name.startswith(("ompmoe.recipes", "ompmoe.lightning",
                                                                             "ompmoe.callbacks", "ompmoe.eval")))
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
        upward = sorted(name for name in _imports(path) if name in ("ompmoe", "ompmoe.__version__"))
        assert not upward, f"{path.relative_to(PACKAGE)} imports its parent package: {upward}"


def test_eval_never_imports_the_recipes_and_the_callbacks_never_import_eval():
    for path in _sources("eval"):
        bad = sorted(name for name in _imports(path) if name.startswith("ompmoe.recipes"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    for path in _sources("callbacks"):
        bad = sorted(name for name in _imports(path) if name.startswith("ompmoe.eval"))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _import_graph() -> dict[str, set[str]]:
    """Every edge: each module a file imports (at any depth, ``__init__`` files included) and the packages that import
    runs first, except the importer's own packages (Python has run those before the importer)."""
    modules = {_module_name(path): path for path in _sources("ompmoe", "callbacks", "eval")}
    graph = {}
    for name, path in modules.items():
        targets = {t for target in _imports(path) if target in modules for t in {target, *_ancestors(target)}}
        graph[name] = {t for t in targets if t in modules and t != name and t not in _ancestors(name)}
    return graph


def test_no_import_cycles_between_modules():
    graph = _import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack[stack.index(target):] + [target])}")
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


LAYERS = (
    ("ompmoe._lazy", "ompmoe._quiet", "ompmoe.engine"),  # the engine's ground: modules beside its stage folders
    ("ompmoe.engine.collect",),
    ("ompmoe.engine.planning",),
    ("ompmoe.engine.methods",),
    ("ompmoe.engine.apply",),
    ("ompmoe.engine.export",),
    ("ompmoe.engine.run", "ompmoe.engine.summary"),
    ("ompmoe.data",),
    ("ompmoe.cli_args", "ompmoe.cli_options"),
    ("ompmoe.lightning", "ompmoe.callbacks"),
    ("ompmoe.eval",),
    ("ompmoe.recipes",),
    ("ompmoe.cli", "ompmoe.cli_help", "ompmoe.help_cache", "ompmoe.__main__"),
)
"""Bottom to top: a module imports its own layer and the ones below, never one above."""


def _layer(name: str) -> int:
    """The rank of the longest prefix of ``name`` in :data:`LAYERS` (``ompmoe.engine.collect.x`` is collect's)."""
    matches = [(len(prefix), rank) for rank, prefixes in enumerate(LAYERS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    if not matches:
        raise AssertionError(f"{name} belongs to no layer of tests/test_layout.py's LAYERS; add it there")
    return max(matches)[1]


def test_every_engine_folder_is_a_stage_of_the_layers():
    """The engine's folders are the run's stages: each has its own rank in :data:`LAYERS` (a new folder gets one)."""
    folders = {path.name for path in (PACKAGE / "engine").iterdir() if (path / "__init__.py").is_file()}
    staged = {prefix.split(".")[2] for prefixes in LAYERS for prefix in prefixes
              if prefix.startswith("ompmoe.engine.") and prefix.split(".")[2] in folders}
    assert staged == folders == {"collect", "planning", "methods", "apply", "export"}


def test_no_module_imports_a_layer_above_its_own():
    graph = _import_graph()
    upward = sorted(f"{name} -> {target}" for name, targets in graph.items() if name != "ompmoe"
                    for target in targets if target != "ompmoe" and _layer(target) > _layer(name))
    assert not upward, upward


def test_importing_the_engine_loads_no_lightning_and_no_recipe():
    code = ("import sys, ompmoe.engine.planning.plan, ompmoe.engine.collect.collector, ompmoe.engine.apply.pruning, ompmoe.engine.planning.strategy, "
            "ompmoe.data.sources;"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'lightning' or m.startswith(('ompmoe.recipes', "
            "'ompmoe.lightning')));print(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"



def test_planning_and_plotting_from_saved_statistics_never_import_torchmetrics(tmp_path):
    """``ompmoe prune``, ``ompmoe plot`` and planning from Python read sums and never fill them, so torchmetrics (about
    a second to import) stays out of their process; the first collection loads it (collect/sums.py)."""
    from ompmoe.engine.collect.synthetic import synthetic_stats

    stats = synthetic_stats(2, 8, 2).save(tmp_path / "stats.safetensors")
    code = (f"import sys\nfrom ompmoe.cli import main\nS = {str(stats)!r}\n"
            f"main(['prune', '--stats', S, '--ratio', '0.25,0.5', '--output_dir', {str(tmp_path / 'p')!r}, '--quiet'])\n"
            f"main(['plot', '--stats', S, '--output_dir', {str(tmp_path / 'plots')!r}, '--quiet'])\n"
            "import ompmoe, ompmoe.engine.methods, ompmoe.engine.apply.compensation_step, ompmoe.engine.export.streamed\n"
            "ompmoe.plan_pruning(ompmoe.MoEStats.load(S), 0.5, method='reap', allocation='uniform')\n"
            "print('torchmetrics' in sys.modules)\n"
            "from ompmoe.engine.tiny import tiny_model\n"
            "ompmoe.collect_stats(tiny_model('qwen3_moe'), [__import__('torch').arange(3, 19).view(2, 8)])\n"
            "print('torchmetrics' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
    assert (tmp_path / "p" / "plan-0.5.json").is_file() and (tmp_path / "plots" / "heatmaps.png").is_file()

def test_pyproject_installs_every_package_and_every_shipped_model():
    """A wheel (``pip install ompmoe``, not editable) holds only the packages and data pyproject lists."""
    import tomllib

    from ompmoe.data import SHIPPED_MODELS

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {_module_name(path) for directory in ("ompmoe", *INSTALLED_AS) for path in _sources(directory)
                if path.name == "__init__.py"}
    assert packages == set(setuptools["packages"])
    data = setuptools["package-data"]["ompmoe.data"]
    assert {f"{name}/*" for name in SHIPPED_MODELS} <= set(data)
    for name in SHIPPED_MODELS:  # no subfolder a "name/*" pattern would miss
        assert all(path.is_file() for path in (PACKAGE / "data" / name).iterdir())


ADAPTERS = ("callbacks/pruning.py", "ompmoe/lightning/fabric.py", "ompmoe/lightning/fabric_prune.py",
            "ompmoe/engine/ranks.py")
"""The front doors' Lightning/Fabric glue over ``PruningRun`` (and the rank helpers it needs): hooks only."""


def test_the_front_doors_stay_thin_adapters_over_the_run():
    lines = {name: len((ROOT / name).read_text().splitlines()) for name in ADAPTERS}
    assert sum(lines.values()) <= 600, (f"the adapters over PruningRun grew to {sum(lines.values())} lines "
                                        f"(at most 600): {lines}; move the new logic into ompmoe/engine/run.py")
