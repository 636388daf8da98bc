"""Command-line spellings the ``ompmoe`` command accepts beyond jsonargparse's own, rewritten into its form.

jsonargparse wants ``--ratio [0.25,0.5]``, ``--overwrite true`` and import paths; users type what other tools
accept (``--ratio 0.25,0.5``, ``--ratio 0.25 0.5``, a bare ``--overwrite``, ``--trainer.callbacks.help ExpertPruning``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from argparse import ArgumentError
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .cli_options import parser_options, unknown_options_line

# Short names users give to ``--<...>.help``; jsonargparse needs the import path.
CLASS_PATHS = {
    "ExpertPruning": "ompmoe.callbacks.ExpertPruning",
    "AdaptiveInferenceMonitor": "ompmoe.callbacks.AdaptiveInferenceMonitor",
    "PruningStrategy": "ompmoe.engine.planning.strategy.PruningStrategy",
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


def names_option(argv: Sequence[str], name: str) -> list[str]:
    """``--name a,b`` (and ``--name=a,b``) as ``--name [a,b]``, the list jsonargparse reads; a value in brackets or
    YAML quotes is kept as it is."""
    flag, result = f"--{name}", list(argv)
    for index, token in enumerate(result):
        if token.startswith(flag + "="):
            key, value = flag, token.split("=", 1)[1]
        elif token == flag and index + 1 < len(result):
            key, value, index = flag, result[index + 1], index + 1
        else:
            continue
        if not value.lstrip().startswith(("[", "'", '"')):
            items = ",".join(json.dumps(item.strip()) for item in value.split(",") if item.strip())
            result[index] = f"[{items}]" if token == flag else f"{key}=[{items}]"
    return result


def bare_flags(argv: Sequence[str], names: Iterable[str]) -> list[str]:
    """A boolean ``--name`` given without a value means ``--name true`` (as in argparse's store_true)."""
    flags = {f"--{name}" for name in names}
    result = []
    for token, following in zip(argv, [*argv[1:], ""]):
        result.append(token)
        if token in flags and following.lower() not in {"true", "false"}:
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
    """Every ``-c``/``--config`` file exists and is no other ompmoe input (statistics, a plan, a model, a run's
    folder, results), else one line naming it (what it is, or the nearest existing path) and what to do.

    jsonargparse answers a missing config with its whole usage text, and statistics or a plan with a decoding or
    an unknown-option error; this runs first.
    """
    from .engine.collect.input_kinds import input_kind
    from .engine.names import nearest_path_hint

    for index, token in enumerate(argv):
        if token in ("-c", "--config") and index + 1 < len(argv):
            flag, path = token, argv[index + 1]
        elif token.startswith("--config="):
            flag, path = "--config", token.removeprefix("--config=")
        else:
            continue
        kind = input_kind(Path(path).expanduser())
        if kind is not None:
            raise ValueError(_not_a_config(flag, path, kind))
        if not Path(path).expanduser().is_file():
            raise FileNotFoundError(f"config file {path!r} does not exist{nearest_path_hint(path)}")


def _not_a_config(flag: str, path: str, kind: str) -> str:
    """The line for an ompmoe input of ``kind`` given as a config file: what it is, and where it goes instead."""
    from .engine.collect.input_kinds import KINDS, RUN_FILES

    folder = Path(path) if kind == "run" else Path(path).parent
    beside = folder / RUN_FILES["statistics"]
    found = kind in ("plan", "run") and beside.expanduser().is_file()
    replan = "ompmoe prune --stats {} --ratio R --output_dir DIR".format
    fixes = {
        "statistics": f"prune from it with {replan(path)}",
        "plan": (f"prune from its statistics with {replan(beside)} (it reads this plan's settings)" if found else
                 f"prune from the statistics it was made from with {replan('STATS.safetensors')}"),
        "run": f"prune from its statistics with {replan(beside)}" if found else "give a YAML config file",
        "model": f"give the model as --model.model {path}",
        "results": f"compare results with ompmoe report {path} ...",
        "weights": f"give the model folder as --model.model {Path(path).parent}",
    }
    return (f"{flag} {path} is {KINDS[kind]}, not a config file (YAML, e.g. configs/tiny.yaml): "
            f"{fixes.get(kind, 'give a YAML config file')}")


class CommandError(SystemExit):
    """Exit status 2, as argparse's usage errors; ``str()`` is the one ``error:`` line already printed."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def fail(error: BaseException) -> NoReturn:
    """End a command on a user error: its one ``error:`` line on stderr, exit status 2."""
    print(f"error: {error}", file=sys.stderr)
    raise CommandError(f"error: {error}") from None


def user_errors() -> tuple[type[BaseException], ...]:
    """What a command reports as one ``error:`` line (exit status 2). Not AttributeError or TypeError: that is how a
    bug shows itself, and its traceback must stay visible. A write that fails midway (full disk, file-size limit,
    quota, read-only file system; safetensors' and other libraries' errors too) arrives as ``OutputNotWritableError``
    (``ompmoe.engine.io.atomic_path`` converts it), and so does another live run writing the same output
    (``OutputInUseError``)."""
    from .engine.io import OutputNotWritableError

    return (ValueError, FileExistsError, FileNotFoundError, ConnectionError, PermissionError, OutputNotWritableError)


SHORT_OPTIONS = {"ratio": "strategy", "method": "strategy", "allocation": "strategy", "output_dir": "run",
                 "overwrite": "run", "layer_by_layer": "run", "compensation": "run"}
"""The options every front door takes by their short names (``fit`` maps them into its ``ExpertPruning``)."""
SCRIPT_SKIPS = {"strategy", "tokenizer", "dtype"}
"""Run options a script names otherwise: the strategy's own fields, ``--model.tokenizer``, ``--save_dtype``."""


def add_run_options(parser: Any, short_only: bool = False) -> None:
    """Every option of :class:`~ompmoe.engine.run.RunOptions` and ``PruningStrategy`` as a flat ``--name``, with
    the help of their one declaration; ``short_only``: just :data:`SHORT_OPTIONS`, all defaulting to ``None``
    (given ones then replace the config's)."""
    from .engine.planning.strategy import PruningStrategy
    from .engine.run import RunOptions

    if short_only:
        for name, owner in SHORT_OPTIONS.items():
            source = PruningStrategy if owner == "strategy" else RunOptions
            annotation = {"ratio": float, "overwrite": bool, "layer_by_layer": bool}.get(name, str)
            parser.add_argument(f"--{name}", type=annotation | None, default=None,  # type: ignore[operator]
                                help=f"{_field_help(source, name)} (replaces the ExpertPruning callback's "
                                     f"{'strategy.' * (owner == 'strategy')}{name})")
        return
    parser.add_class_arguments(PruningStrategy, None)
    parser.add_class_arguments(RunOptions, None, skip=SCRIPT_SKIPS)
    parser.add_argument("--save_dtype", type=str | None, default=None, help=_field_help(RunOptions, "dtype"))


def _field_help(cls: type, name: str) -> str:
    """The ``Args:`` text of ``name`` in ``cls``'s docstring (its one declaration), on one line."""
    import docstring_parser  # jsonargparse[signatures] reads help from docstrings with it too

    docs = {param.arg_name: param.description for param in docstring_parser.parse(cls.__doc__ or "").params}
    return " ".join((docs.get(name) or "").split())


def run_from_arguments(args: Any, owner: str, tokenizer: Any = None) -> Any:
    """The :class:`~ompmoe.engine.run.PruningRun` the flat options of :func:`add_run_options` describe (validated)."""
    from .engine.planning.strategy import PruningStrategy
    from .engine.run import PruningRun, RunOptions

    strategy = PruningStrategy(**{f.name: args[f.name] for f in dataclasses.fields(PruningStrategy)})
    options = {f.name: args[f.name] for f in dataclasses.fields(RunOptions) if f.name not in SCRIPT_SKIPS}
    return PruningRun(RunOptions(strategy=strategy, dtype=args.save_dtype, tokenizer=tokenizer, **options), owner=owner)


def parse_or_raise(parser: Any, argv: Sequence[str], prog: str) -> Any:
    """``parser.parse_args`` with jsonargparse's multi-line usage errors as one ``ValueError`` line."""
    try:
        return parser.parse_args(list(argv))
    except ArgumentError as error:
        raise ValueError(unknown_options_line(str(error), parser_options(parser), prog)) from None


__all__ = ["CLASS_PATHS", "CommandError", "SHORT_OPTIONS", "fail", "add_run_options", "bare_flags", "class_paths",
           "list_option", "names_option", "parse_or_raise", "run_from_arguments", "user_errors"]
