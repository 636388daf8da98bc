"""Markdown tables like the paper's Table 1 (and Table 6's Cost/Speedup) from evaluation result files.

One row per results file, one column per score; the average covers only tasks every row scored and that tell the
models apart, "retained" is its share of the baseline's, and Speedup is rated by :mod:`ompmoe.eval.timing`. Rows
that do not compare are refused unless ``allow_mismatch``; the notes say what every mark means. Columns, marks
and refusals: docs/evaluation.md, "Reports: ``ompmoe report``".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .comparability import NOISY_ITEMS, item_count, item_problems, problems, stderr_of, unrecorded
from .labels import model_label
from .timing import MIN_REPEATS, TIMES, samples_of
from .timing import speedup as timed_speedup

MISSING = "–"
MARK = "⚠"
NOISY = "†"
LEFT_OUT = "‡"
UNRATED = "§"
NOT_SIGNIFICANT = "n.s."


class IncomparableResultsError(ValueError):
    """Result files that would compare different base models, tokenizers or task versions, or that were scored on
    other items (another ``--data.limit``)."""


class ResultsFileError(ValueError):
    """A results file ``ompmoe report`` cannot read: not JSON, or a key missing or of the wrong type."""


_FIX = ("Re-create it with `ompmoe validate` / `ompmoe test` (LMEvalDataModule(output_path=...)), "
        "or restore that key.")

_TABLES = {"n-samples": dict, "results": dict, "groups": dict, "group_subtasks": list}  # task -> entry of this type
_TYPE_NAMES = {dict: "an object", list: "a list"}
# (key path, type, required) of what the report reads; everything else in a results file is ignored.
_SCHEMA: tuple[tuple[tuple[str, ...], type, bool], ...] = (
    (("ompmoe",), dict, True),
    (("ompmoe", "columns"), list, True),
    (("ompmoe", "scores"), dict, True),
    (("ompmoe", "model"), dict, False),
    (("ompmoe", "cost"), dict, False),
    (("ompmoe", "cost", "timing"), dict, False),
    *((("ompmoe", "cost", "timing", name), list, False) for name in TIMES),
    *(((key,), dict, False) for key in ("config", "versions", *_TABLES)),  # each table an object of task -> entry
)


def check_results(data: Any, where: str) -> dict[str, Any]:
    """``data`` if it has every key the report reads, with the right types; else one
    :class:`ResultsFileError` naming ``where``, the key and the fix."""
    if not isinstance(data, dict):
        raise ResultsFileError(
            f"{where} is not a results file: it holds {type(data).__name__}, not a JSON object. {_FIX}")
    if "ompmoe" not in data:
        raise ResultsFileError(
            f"{where} has no 'ompmoe' summary; it was not written by ompmoe.eval.LMEvalDataModule (plain lm-eval "
            f"output cannot be reported). {_FIX}"
        )

    def check_type(dotted: str, value: Any, kind: type) -> None:
        if not isinstance(value, kind):
            raise ResultsFileError(
                f"{where}: '{dotted}' must be {_TYPE_NAMES[kind]}, got {type(value).__name__}. {_FIX}")

    for path, kind, required in _SCHEMA:
        value: Any = data
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None and required:
            raise ResultsFileError(f"{where} has no key '{'.'.join(path)}'. {_FIX}")
        if value is not None:
            check_type(".".join(path), value, kind)
    for index, column in enumerate(data["ompmoe"]["columns"]):
        if not isinstance(column, dict) or not isinstance(column.get("name"), str):
            raise ResultsFileError(
                f"{where}: 'ompmoe.columns[{index}]' must be an object with a string 'name'. {_FIX}")
    for table, kind in _TABLES.items():
        for task, entry in (data.get(table) or {}).items():
            check_type(f"{table}.{task}", entry, kind)
    for task, entry in (data.get("n-samples") or {}).items():
        count = entry.get("effective", entry.get("original"))
        if isinstance(count, bool) or not isinstance(count, int):
            raise ResultsFileError(f"{where}: 'n-samples.{task}.effective' must be an integer, got {count!r}. {_FIX}")
    timing = (data["ompmoe"].get("cost") or {}).get("timing") or {}
    for name in TIMES:
        for index, value in enumerate(timing.get(name) or []):
            if _number(value) is None or value < 0:
                raise ResultsFileError(f"{where}: 'ompmoe.cost.timing.{name}[{index}]' must be a finite number of "
                                       f"seconds >= 0, got {value!r}. {_FIX}")
    return data


def load_results(path: str | Path) -> dict[str, Any]:
    """A results JSON; refuses unreadable files and files without ompmoe's summary (e.g. plain lm-eval output)."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ResultsFileError(f"cannot read results file {path}: {error.strerror or error}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ResultsFileError(f"{path} is not JSON ({error}). {_FIX}") from None
    return check_results(data, str(path))


def _cell(text: Any) -> str:
    """Cell text: ``|`` escaped, newlines made spaces, so no label, task or metric ends its row or adds columns."""
    return " ".join(str(text).replace("|", "\\|").splitlines())


def _number(value: Any) -> float | None:
    """A finite number, else ``None`` (missing, NaN, infinite, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return float(value)


def _seconds(value: float) -> str:
    """Seconds with three significant digits (whole seconds from 100 s on), as the paper's "2459s"."""
    if value >= 100 or value <= 0:
        return f"{value:.0f}"
    return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}"


def _distinct(names: Sequence[str], files: Sequence[str | None]) -> list[str]:
    """``names`` with repeats told apart by their file name (or row number)."""
    out = list(names)
    for index, (name, file) in enumerate(zip(names, files)):
        if names.count(name) > 1:
            out[index] = f"{name} [{Path(file).stem}]" if file else f"{name} [row {index}]"
    if len(set(out)) < len(out):
        out = [f"{name} [row {index}]" if out.count(name) > 1 else name for index, name in enumerate(out)]
    return out


def _row_label(summary: Mapping[str, Any]) -> str:
    """The file's label, else one made from its recorded model and plan."""
    label = summary.get("label")
    return str(label) if label not in (None, "") else model_label(summary.get("model") or {})


def _uninformative(values: Sequence[float], chance: Any, items: int | None) -> str | None:
    """Why a task (percent scores of every row) says nothing about the models, or ``None``."""
    if all(value == 0 for value in values):
        return "every model scores 0"
    chance = _number(chance)
    if chance is None:
        return None
    margin = 100 / items if items else 0.0
    if all(value <= 100 * chance + margin + 1e-9 for value in values):
        within = f", or within one item ({margin:.1f} points) of it" if items else ""
        return f"no model scores above chance ({100 * chance:.1f}%{within})"
    return None


def _cost_settings(row: Mapping[str, Any]) -> str:
    """Where a row's cost was measured: device, threads, dtype, experts implementation."""
    cost, model = row["ompmoe"].get("cost") or {}, row["ompmoe"].get("model") or {}
    parts = [str(cost.get("device") or "unknown device")]
    if cost.get("threads"):
        parts.append(f"{cost['threads']} thread{'s' if cost['threads'] != 1 else ''}")
    if cost.get("ranks", 1) != 1:
        parts.append(f"{cost['ranks']} ranks")
    parts.append(str(model.get("dtype") or "unknown dtype"))
    parts.append(f"{model.get('experts_implementation') or 'default'} experts")
    return ", ".join(parts)


COST_TIMES = {"wall": "seconds", "cpu": "cpu_seconds"}
"""``cost_time`` choices: the recorded field the Cost column shows."""


def report_table(results: Sequence[Mapping[str, Any] | str | Path], baseline: int | str | None = None,
                 labels: Sequence[str] | None = None, digits: int = 2, allow_mismatch: bool = False,
                 noisy_items: int = NOISY_ITEMS, cost_time: str = "wall") -> str:
    """The Markdown table of ``results`` (dicts or JSON paths), one row each, in order.

    Args:
        results: Result dicts or files from :class:`ompmoe.eval.LMEvalDataModule`.
        baseline: Row (index or label) whose average is 100% and whose cost is speedup 1; default: the
            first unpruned model, else the first row.
        labels: Row labels instead of the files' own.
        digits: Decimals of the scores.
        allow_mismatch: Print rows that cannot be compared with the baseline, marked, instead of refusing them.
        noisy_items: Columns of tasks with fewer items are flagged as noisy.
        cost_time: ``wall`` (the paper's Cost) or ``cpu`` (process CPU time, less disturbed on a shared CPU).
    """
    if cost_time not in COST_TIMES:
        raise ValueError(f"cost_time must be one of {sorted(COST_TIMES)}, got {cost_time!r}.")
    files = [str(item) if isinstance(item, (str, Path)) else None for item in results]
    rows = [load_results(item) if isinstance(item, (str, Path)) else check_results(dict(item), f"results[{index}]")
            for index, item in enumerate(results)]
    if not rows:
        raise ValueError("report_table needs at least one result file.")
    summaries = [row["ompmoe"] for row in rows]
    names = list(labels) if labels is not None else [_row_label(summary) for summary in summaries]
    if len(names) != len(rows):
        raise ValueError(f"{len(names)} labels for {len(rows)} result files.")
    columns: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for column in summary["columns"]:
            columns.setdefault(column["name"], column)

    def percent(name: str) -> bool:
        return bool(columns[name].get("higher_is_better", True))

    def cell(summary: Mapping[str, Any], name: str) -> float | None:
        value = _number(summary["scores"].get(name))
        return 100 * value if value is not None and percent(name) else value

    table = [[cell(summary, name) for name in columns] for summary in summaries]
    base = _baseline_index(summaries, names, baseline)
    names = _distinct(names, files)
    mismatched = problems(rows, base, names)
    if mismatched and not allow_mismatch:
        details = "; ".join(f"{names[i]!r}: {', '.join(issues)}" for i, issues in mismatched.items())
        raise IncomparableResultsError(
            f"These results cannot be compared with the baseline {names[base]!r}: {details}. Compare a model with "
            "its own pruned versions, evaluated with the same tokenizer and task versions; or pass "
            "allow_mismatch=True (CLI: --allow-mismatch) to print them marked, without a retained percentage."
        )
    other_items = item_problems(rows, base)
    if other_items and not allow_mismatch:
        def where(index: int) -> str:
            return files[index] or repr(names[index])

        details = "; ".join(f"{where(i)} {issue}" for i, issue in other_items.items())
        raise IncomparableResultsError(
            f"These results cannot be compared with the baseline {where(base)}: {details}, so a retained percentage "
            "or speedup would compare different questions. Rerun one of them with the same --data.limit as the other "
            "(and the same data sets); or pass allow_mismatch=True (CLI: --allow-mismatch) to print them marked, "
            "without a retained percentage or speedup."
        )
    for index, issue in other_items.items():
        mismatched.setdefault(index, []).append(issue)
    counts = {name: [item_count(row, column.get("source", name)) for row in rows] for name, column in columns.items()}
    fewest = {name: min((c for c in values if c is not None), default=None) for name, values in counts.items()}
    # Noise in the metric's own terms: "one item is x points" only for scores that are fractions of items.
    noisy = {name: count for name, count in fewest.items()
             if percent(name) and count is not None and count < noisy_items}

    # The average covers the primary higher-is-better tasks that every row scored (a finite number) and that tell
    # the models apart (not all 0, not all at chance); left-out tasks are named in the notes.
    left_out: dict[str, str] = {}
    averaged: list[int] = []
    for i, (name, column) in enumerate(columns.items()):
        if not (column.get("primary", True) and percent(name)):
            continue
        absent = [names[r] for r, values in enumerate(table) if values[i] is None]
        reason = (f"no finite score for {', '.join(absent)}" if absent else
                  _uninformative([values[i] for values in table], column.get("chance"), fewest[name]))
        if reason:
            left_out[name] = reason
        else:
            averaged.append(i)
    averages = [sum(values[i] for i in averaged) / len(averaged) if averaged else None for values in table]

    costs = [_number((summary.get("cost") or {}).get(COST_TIMES[cost_time])) for summary in summaries]
    with_cost = any(cost is not None for cost in costs)
    speedups, unrated, not_significant, timed = _speedups(summaries, names, base, costs, COST_TIMES[cost_time],
                                                           set(mismatched))

    marked = [name + (f" {NOISY}" if name in noisy else "") + (f" {LEFT_OUT}" if name in left_out else "")
              for name in columns]
    header = ["Model", *marked, "Average", "Retained (%)"]
    if with_cost:
        header += ["Cost (s)" if cost_time == "wall" else "Cost (CPU s)", "Speedup"]
    lines = ["| " + " | ".join(_cell(name) for name in header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
    any_stderr = False
    for index, (name, values, average) in enumerate(zip(names, table, averages)):
        retained = 100 * average / averages[base] if average is not None and averages[base] else None
        if index in mismatched:  # _speedups left their cell empty
            name, retained = f"{name} {MARK}", None
        formatted = []
        for (column_name, column), value in zip(columns.items(), values):
            error = stderr_of(rows[index], column.get("source", column_name), column.get("metric", ""))
            if value is None or error is None:
                formatted.append(MISSING if value is None else f"{value:.{digits}f}")
            else:
                any_stderr = True
                error = 100 * error if percent(column_name) else error
                formatted.append(f"{value:.{digits}f} ± {error:.{digits}f}")
        formatted += [MISSING if average is None else f"{average:.{digits}f}",
                      MISSING if retained is None else f"{retained:.1f}"]
        if with_cost:
            formatted += [MISSING if costs[index] is None else _seconds(costs[index]), speedups[index] or MISSING]
        lines.append("| " + " | ".join([_cell(name), *formatted]) + " |")
    lower = [name for name in columns if not percent(name)]
    notes = [
        f"Scores in %, except {', '.join(map(_cell, lower))} (lower is better)" if lower else "Scores in %",
        f"Average over {', '.join(_cell(list(columns)[i]) for i in averaged)}" if averaged else "No column is averaged",
        f"Retained: Average as a percentage of {_cell(names[base])}'s",
    ]
    for column_name, reason in left_out.items():
        notes.append(f"{LEFT_OUT} {_cell(column_name)} is left out of Average and Retained: {_cell(reason)}")
    if with_cost:
        measured = [(name, _cost_settings(row)) for name, row, cost in zip(names, rows, costs) if cost is not None]
        where = (f"on {measured[0][1]}" if len({s for _, s in measured}) == 1 else
                 "on " + "; ".join(f"{_cell(n)}: {s}" for n, s in measured))
        what = "wall time" if cost_time == "wall" else "process CPU time"
        notes.append(f"Cost: {what} of the evaluation loop (model work, without task loading and scoring) {where}")
        notes += _speedup_notes(summaries, names, base, unrated, not_significant, timed, what)
    if any_stderr:
        notes.append("± is lm-eval's standard error")
    for column_name, count in noisy.items():
        notes.append(f"{NOISY} {_cell(column_name)}: {count} items (< {noisy_items}); a difference of "
                     f"{100 / count:.1f} points is one item, treat it as noise")
    for index, issues in mismatched.items():
        notes.append(f"{MARK} {_cell(names[index])} is not comparable with {_cell(names[base])}: "
                     f"{_cell(', '.join(issues))}")
    missing = [names[i] for i in unrecorded(rows)]
    if missing:
        notes.append(f"Base model or tokenizer not recorded for {', '.join(map(_cell, missing))} "
                     "(older results files): their comparability was not checked")
    return "\n".join(lines) + "\n\n" + ". ".join(notes) + ".\n"


def _speedups(summaries: Sequence[Mapping[str, Any]], names: Sequence[str], base: int, costs: Sequence[float | None],
              time: str, mismatched: set[int]) -> tuple[list[str | None], dict[int, str], dict[int, str], bool]:
    """Each row's Speedup cell (``None``: nothing to show), the unrated rows (why), the ``n.s.`` rows (speedup
    and interval) and whether any row was timed: :func:`~ompmoe.eval.timing.speedup` of the repeats of ``time``."""
    timings = [(summary.get("cost") or {}).get("timing") or {} for summary in summaries]
    samples = [samples_of(timing, time) for timing in timings]
    cells: list[str | None] = []
    unrated: dict[int, str] = {}
    not_significant: dict[int, str] = {}
    timed = False
    for index, cost in enumerate(costs):
        if index == base:
            cells.append("1.00×" if cost is not None else None)
            continue
        if index in mismatched or (samples[index] is None and (cost is None or costs[base] is None)):
            cells.append(None)
            continue
        inputs = (timings[base].get("inputs"), timings[index].get("inputs"))
        if samples[base] is not None and samples[index] is not None and (None in inputs or inputs[0] == inputs[1]):
            timed = True
            found = timed_speedup(samples[base], samples[index])
            cells.append(str(found) if found.significant else NOT_SIGNIFICANT)
            if not found.significant:
                not_significant[index] = str(found)
            continue
        if samples[index] is None:
            unrated[index] = "no repeated timing recorded"
        elif samples[base] is None:
            unrated[index] = f"{_cell(names[base])} has no repeated timing"
        else:
            unrated[index] = f"its timing probe ran other inputs than {_cell(names[base])}'s"
        cells.append(f"{costs[base] / cost:.2f}× {UNRATED}" if cost and costs[base] else UNRATED)
    return cells, unrated, not_significant, timed


def _speedup_notes(summaries: Sequence[Mapping[str, Any]], names: Sequence[str], base: int, unrated: Mapping[int, str],
                   not_significant: Mapping[int, str], timed: bool, what: str) -> list[str]:
    """What the Speedup column means (it compares ``what``), and the footnotes of its ``n.s.`` and unrated cells."""
    base_name = _cell(names[base])
    notes = []
    if timed:
        timing = (summaries[base].get("cost") or {}).get("timing") or {}
        warmup = timing.get("warmup")
        probe = (f"{timing.get('batches')} batches, {timing.get('tokens')} tokens, run again after the loop: "
                 f"{warmup} warm-up pass{'' if warmup == 1 else 'es'}, then {timing.get('repeats')} timed repeats")
        notes.append(
            f"Speedup: {base_name}'s median {what} over the repeats of its timing probe ({probe}) divided by the "
            "row's, not the ratio of the Cost columns (one pass each, warm-up included); in parentheses the lowest "
            f"and highest ratio of one {base_name} repeat to one row repeat")
    elif not unrated:
        notes.append(f"Speedup: {base_name}'s Cost divided by the row's")
    if not_significant:
        rows = "; ".join(f"{_cell(names[index])} {value}" for index, value in not_significant.items())
        notes.append(f"{NOT_SIGNIFICANT}: speedup not told apart from 1.00× (its interval includes 1.00, or its "
                     f"half-width is not smaller than its distance from 1): {rows}")
    if unrated:
        by_reason: dict[str, list[str]] = {}
        for index, reason in unrated.items():
            by_reason.setdefault(reason, []).append(_cell(names[index]))
        reasons = "; ".join(f"{', '.join(rows)} ({reason})" for reason, rows in by_reason.items())
        notes.append(
            f"{UNRATED} Speedup unrated for {reasons}: {base_name}'s Cost divided by the row's, one run each, so its "
            f"run-to-run spread is unknown. Results files written before the timing probe, or with fewer than "
            f"{MIN_REPEATS} timed repeats, record no spread; evaluate again to rate it")
    return notes


def _baseline_index(summaries: Sequence[Mapping[str, Any]], names: Sequence[str], baseline: int | str | None) -> int:
    if isinstance(baseline, int):
        if not 0 <= baseline < len(summaries):
            raise ValueError(f"baseline={baseline} is not a row (0..{len(summaries) - 1}).")
        return baseline
    if isinstance(baseline, str):
        if baseline.isdigit():
            return _baseline_index(summaries, names, int(baseline))
        if baseline not in names:
            raise ValueError(f"baseline {baseline!r} is not one of the rows {list(names)}.")
        return list(names).index(baseline)
    unpruned = (index for index, summary in enumerate(summaries) if not (summary.get("model") or {}).get("pruning"))
    return next(unpruned, 0)


def report(results: list[str], output: str | None = None, baseline: str | None = None,
           labels: list[str] | None = None, digits: int = 2, allow_mismatch: bool = False,
           noisy_items: int = NOISY_ITEMS, overwrite: bool = False, cost_time: str = "wall") -> str:
    """Print (and with ``output``, write) the Markdown table of evaluation result files.

    ``output`` is written atomically, never over one of ``results``, and over an existing file only with
    ``overwrite``; the other arguments are :func:`report_table`'s.
    """
    from ..engine.io import atomic_path, check_writable

    if output is not None:
        target = Path(output).resolve()
        for item in results:  # the table must never replace one of the results files it is made from
            source = Path(item).resolve()
            if source == target or (target.exists() and source.exists() and os.path.samefile(source, target)):
                raise ValueError(
                    f"--output {output} is one of the results files being reported; writing the table there would "
                    "destroy those results. Choose another output path, e.g. table.md."
                )
        check_writable(output, overwrite, directory=False, inputs=results)  # before reading anything
    table = report_table(results, baseline=baseline, labels=labels, digits=digits, allow_mismatch=allow_mismatch,
                         noisy_items=noisy_items, cost_time=cost_time)
    if output is not None:
        with atomic_path(output, overwrite=overwrite, inputs=results) as tmp:
            tmp.write_text(table)
    print(table, end="")
    return table


def report_cli(argv: list[str] | None = None) -> str:
    """``ompmoe report RESULTS.json [RESULTS.json ...] [--output table.md] [--baseline LABEL|ROW]``.

    Bad input (arguments, results files, an output it may not write) raises a ``ValueError`` or ``OSError`` of
    :func:`ompmoe.cli_args.user_errors`: ``ompmoe`` prints one ``error:`` line, exit status 2, as for every command.
    """
    import argparse
    import sys

    from ..cli_args import bare_flags
    from ..cli_options import parser_options, unknown_options_line

    parser = argparse.ArgumentParser(prog="ompmoe report", description=report.__doc__.splitlines()[0],
                                     allow_abbrev=False)  # --cost-tim is a typo, not --cost-time

    def usage_error(message: str) -> None:  # one ValueError line naming the option meant, as every ompmoe command
        raise ValueError(unknown_options_line(message, parser_options(parser), "ompmoe report"))

    parser.error = usage_error  # type: ignore[method-assign]
    parser.add_argument("results", nargs="+", help="result JSON files of ompmoe validate/test (LMEvalDataModule)")
    parser.add_argument("--output", help="also write the table to this Markdown file (refused if it exists)")
    parser.add_argument("--overwrite", type=_true_or_false, default=False, metavar="true|false",
                        help="replace an existing --output file (never one of the results files); "
                             "a bare --overwrite means true")
    parser.add_argument("--baseline", help="label or row number of the original model (default: first unpruned)")
    parser.add_argument("--labels", nargs="+", help="row labels instead of the files' own")
    parser.add_argument("--digits", type=int, default=2, help="decimals of the scores")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="print rows of another base model, tokenizer, task version or item count (--data.limit), "
                             "marked, instead of refusing them")
    parser.add_argument("--noisy-items", type=int, default=NOISY_ITEMS,
                        help=f"flag tasks with fewer items as noisy (default {NOISY_ITEMS})")
    parser.add_argument("--cost-time", choices=sorted(COST_TIMES), default="wall",
                        help="Cost column: wall time of the evaluation loop (default, the paper's) or its CPU time")
    args = parser.parse_args(bare_flags(list(sys.argv[1:] if argv is None else argv), ["overwrite"]))
    return report(**vars(args))


def _true_or_false(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise ValueError(value)
    return value.lower() == "true"
