"""Command-line spellings the ``ompmoe`` command accepts beyond jsonargparse's own, rewritten into its form.

jsonargparse wants ``--ratio [0.25,0.5]``, ``--overwrite true`` and import paths; users type what other tools
accept (``--ratio 0.25,0.5``, ``--ratio 0.25 0.5``, a bare ``--overwrite``, ``--trainer.callbacks.help ExpertPruning``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

# Short names users give to ``--<...>.help``; jsonargparse needs the import path.
CLASS_PATHS = {
    "ExpertPruning": "ompmoe.callbacks.ExpertPruning",
    "AdaptiveInferenceMonitor": "ompmoe.callbacks.AdaptiveInferenceMonitor",
    "PruningStrategy": "ompmoe.engine.strategy.PruningStrategy",
    "CalibrationModule": "ompmoe.lightning.calibration_module.CalibrationModule",
    "CalibrationDataModule": "ompmoe.lightning.calibration_data.CalibrationDataModule",
}


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def list_option(argv: Sequence[str], name: str) -> list[str]:
    """``--name 0.3``, ``--name 0.25,0.5``, ``--name 0.25 0.5`` and ``--name=0.25,0.5`` as ``--name [..]``.

    A value already in brackets, or one that is not a list of numbers, is kept as it is, so
    jsonargparse reports malformed ones itself.
    """
    flag, result, i = f"--{name}", [], 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token != flag and not token.startswith(flag + "="):
            result.append(token)
            continue
        values = [token.split("=", 1)[1]] if "=" in token else []
        while "=" not in token and i < len(argv) and (_is_number(argv[i]) or not argv[i].startswith("-")):
            values.append(argv[i])
            i += 1
        items = [item.strip() for value in values for item in value.split(",") if item.strip()]
        if len(values) == 1 and values[0].lstrip().startswith("["):
            result += [flag, values[0]]
        elif items and all(_is_number(item) for item in items):
            result += [flag, "[" + ",".join(items) + "]"]
        else:  # no value, or not a list of numbers: jsonargparse names what is wrong as given
            result += [flag, *values]
    return result


def bare_flags(argv: Sequence[str], names: Iterable[str]) -> list[str]:
    """A boolean ``--name`` given without a value means ``--name true`` (as in argparse's store_true)."""
    flags = {f"--{name}" for name in names}
    result = []
    for i, token in enumerate(argv):
        result.append(token)
        if token in flags:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is None or following.lower() not in {"true", "false"}:
                result.append("true")
    return result


def class_paths(argv: Sequence[str]) -> list[str]:
    """The short class name after any ``--<key>.help`` (``ExpertPruning``) as its import path."""
    result = []
    for i, token in enumerate(argv):
        if i > 0 and argv[i - 1].endswith(".help") and token in CLASS_PATHS:
            token = CLASS_PATHS[token]
        elif "=" in token:
            key, _, value = token.partition("=")
            if key.endswith(".help") and value in CLASS_PATHS:
                token = f"{key}={CLASS_PATHS[value]}"
        result.append(token)
    return result


def check_config_files(argv: Sequence[str]) -> None:
    """Every ``-c``/``--config`` file exists, else one line naming it and the nearest existing path.

    jsonargparse answers a missing config with its whole usage text; this runs first.
    """
    from .engine.names import nearest_path_hint

    for index, token in enumerate(argv):
        if token in ("-c", "--config") and index + 1 < len(argv):
            path = argv[index + 1]
        elif token.startswith("--config="):
            path = token.removeprefix("--config=")
        else:
            continue
        if not Path(path).expanduser().is_file():
            raise FileNotFoundError(f"config file {path!r} does not exist{nearest_path_hint(path)}")


__all__ = ["CLASS_PATHS", "bare_flags", "class_paths", "list_option"]
