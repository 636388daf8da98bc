"""Old flat module paths (``ompmoe.plan``, ``ompmoe.collect``, ...) keep working, with a DeprecationWarning.

The modules moved into :mod:`ompmoe.engine`, :mod:`ompmoe.lightning` and :mod:`ompmoe.recipes`.
A meta-path finder maps each old name to the module object at its new path (the same object, so
``monkeypatch.setattr("ompmoe.plan.x", ...)`` still patches the real module).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED_MODULES: dict[str, str] = {
    **{name: f"ompmoe.engine.{name}" for name in (
        "adapters", "adaptive", "allocation", "collect", "io", "plan", "pruning", "selection", "statistics", "tiny",
    )},
    "baselines": "ompmoe.engine.methods",
    "strategies": "ompmoe.engine.strategy",
    **{name: f"ompmoe.lightning.{name}" for name in ("calibration_data", "calibration_module", "finetune_module")},
    **{name: f"ompmoe.recipes.{name}" for name in ("quantization", "finetune", "plots", "quickstart")},
}
"""Old module name under ``ompmoe`` -> the module that now holds its contents."""


class _MovedModuleLoader(importlib.abc.Loader):
    def __init__(self, new_name: str) -> None:
        self.new_name = new_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new_name}; import it from there (or use the names exported by ompmoe).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new_name)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module at the new path is already imported."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves ``ompmoe.<old>`` to ``ompmoe.<subpackage>.<old>``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != "ompmoe" or name not in MOVED_MODULES:
            return None
        new_name = MOVED_MODULES[name]
        return importlib.machinery.ModuleSpec(fullname, _MovedModuleLoader(new_name))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
