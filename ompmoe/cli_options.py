"""A mistyped option as one line that names the option meant: argparse's 60-line usage dump ending in
``unrecognized arguments`` becomes ``--data.num_blokcs: did you mean --data.num_blocks?``. Abbreviations are refused
by every ompmoe parser (``allow_abbrev=False``), so a typo is never silently taken as another option."""

from __future__ import annotations

import difflib
import sys
from argparse import ArgumentError
from collections.abc import Iterable
from typing import Any
from unittest import mock

PARSER_SETTINGS = {"exit_on_error": False, "allow_abbrev": False}
"""What every ompmoe parser is built with: errors raised (then printed as one line), no abbreviations."""


def parser_options(parser: Any) -> list[str]:
    """Every ``--option`` an argparse/jsonargparse parser takes, its subcommands' included."""
    options: list[str] = []
    for action in getattr(parser, "_actions", []):
        options += [name for name in action.option_strings if name.startswith("--")]
        for subparser in (getattr(action, "_name_parser_map", None) or {}).values():
            options += parser_options(subparser)
    return list(dict.fromkeys(options))


def unknown_options_line(message: str, options: Iterable[str], command: str) -> str:
    """``unrecognized arguments: --a 1 --b`` as one line, each unknown option with the closest known one."""
    message = " ".join(message.split())
    names = [word.split("=", 1)[0] for word in message.removeprefix("unrecognized arguments:").split()
             if word.startswith("--")]
    if not message.startswith("unrecognized arguments:") or not names:
        return f"{message} (see {command} --help)"
    known = list(options)
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hints.append(f"{name}: did you mean {close[0]}?" if close else f"{name}: no such option")
    return f"unknown option {'; '.join(hints)} (see {command} --help)"


class OneLineErrors:
    """Mixed into a ``LightningCLI`` (``ompmoe fit``, ``validate``, ``test``): its parsers take no abbreviations, and a
    parse error is one ``ValueError`` line naming the option meant (``ompmoe``'s ``main`` prints it, status 2)."""

    def init_parser(self, **kwargs: Any) -> Any:
        return super().init_parser(**kwargs, **PARSER_SETTINGS)  # type: ignore[misc]

    def parse_arguments(self, parser: Any, args: Any) -> None:
        # sys.argv is bare while ``args`` are parsed (LightningCLI warns when both hold arguments), and only then:
        # Lightning runs it again to start a multi-device run's other processes (``ompmoe.cli.lightning_cli``)
        try:
            with mock.patch.object(sys, "argv", sys.argv[:1]):
                super().parse_arguments(parser, args)  # type: ignore[misc]
        except ArgumentError as error:
            command = f"ompmoe {args[0]}" if isinstance(args, list) and args else "ompmoe"
            raise ValueError(unknown_options_line(str(error), parser_options(parser), command)) from None


__all__ = ["OneLineErrors", "PARSER_SETTINGS", "parser_options", "unknown_options_line"]
