"""Markdown tables like the paper's Table 1 from evaluation result files.

Each results JSON written by :class:`ompmoe.eval.LMEvalDataModule` carries an ``ompmoe`` summary:
a label, the model (with its pruning record), and one score per report column. A table has one
row per file, one column per score (accuracies as percentages), the average of the primary
higher-is-better columns, and that average as a percentage of the original model's ("retained").
The original is the ``baseline`` file, else the first file of an unpruned model, else the first.
Perplexities are shown as they are and left out of averages.

Comparisons are honest or refused: a row whose base model (input-embedding fingerprint), tokenizer
(vocabulary fingerprint) or task versions differ from the baseline's is refused unless
``allow_mismatch`` (``--allow-mismatch``), which prints it marked and without a retained
percentage. Scores carry lm-eval's standard errors (``±``) when it computed them, columns of tasks
with fewer than ``noisy_items`` items are flagged as noisy, and equal labels are made distinct.

``ompmoe report original.json omp-0.5.json reap-0.5.json [--output table.md]``
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .comparability import NOISY_ITEMS, item_count, problems, stderr_of, unrecorded

MISSING = "–"
MARK = "⚠"


class IncomparableResultsError(ValueError):
    """Result files that would compare different base models, tokenizers or task versions."""


def load_results(path: str | Path) -> dict[str, Any]:
    """A results JSON; refuses files without ompmoe's summary (e.g. plain lm-eval output)."""
    data = json.loads(Path(path).read_text())
    if "ompmoe" not in data:
        raise ValueError(f"{path} has no 'ompmoe' summary; it was not written by ompmoe.eval.LMEvalDataModule.")
    return data


def _cell(text: Any) -> str:
    """Text as one Markdown table cell: ``|`` escaped and line breaks made spaces, so a label,
    task or metric name cannot end its row or add columns."""
    return " ".join(str(text).replace("|", "\\|").splitlines())


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
        return None
    return float(value)


def _average(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def _distinct(names: Sequence[str], files: Sequence[str | None]) -> list[str]:
    """``names`` with repeats told apart by their file name (or row number)."""
    out = list(names)
    for index, name in enumerate(names):
        if names.count(name) > 1:
            out[index] = f"{name} [{Path(files[index]).stem}]" if files[index] else f"{name} [row {index}]"
    if len(set(out)) < len(out):
        out = [f"{name} [row {index}]" if out.count(name) > 1 else name for index, name in enumerate(out)]
    return out


def report_table(results: Sequence[Mapping[str, Any] | str | Path], baseline: int | str | None = None,
                 labels: Sequence[str] | None = None, digits: int = 2, allow_mismatch: bool = False,
                 noisy_items: int = NOISY_ITEMS) -> str:
    """The Markdown table of ``results`` (dicts or JSON paths), one row each, in order.

    Args:
        results: Result dicts or files from :class:`ompmoe.eval.LMEvalDataModule`.
        baseline: Row (index or label) whose average is 100% ("original"); default: the first
            unpruned model, else the first row.
        labels: Row labels instead of the files' own.
        digits: Decimals of the scores.
        allow_mismatch: Print rows that cannot be compared with the baseline (other base model,
            tokenizer or task versions), marked, instead of refusing them.
        noisy_items: Columns of tasks with fewer items are flagged as noisy.
    """
    files = [str(item) if isinstance(item, (str, Path)) else None for item in results]
    rows = [load_results(item) if isinstance(item, (str, Path)) else dict(item) for item in results]
    if not rows:
        raise ValueError("report_table needs at least one result file.")
    summaries = [row["ompmoe"] for row in rows]
    names = list(labels) if labels is not None else [str(summary.get("label")) for summary in summaries]
    if len(names) != len(rows):
        raise ValueError(f"{len(names)} labels for {len(rows)} result files.")
    columns: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for column in summary.get("columns", []):
            columns.setdefault(column["name"], column)
    averaged = [name for name, column in columns.items() if column.get("primary", True) and column.get("higher_is_better", True)]

    def cell(summary: Mapping[str, Any], name: str) -> float | None:
        value = _number((summary.get("scores") or {}).get(name))
        if value is None:
            return None
        return 100 * value if columns[name].get("higher_is_better", True) else value

    table = [[cell(summary, name) for name in columns] for summary in summaries]
    averages = [_average([values[i] for i, name in enumerate(columns) if name in averaged]) for values in table]
    base = _baseline_index(summaries, names, baseline)
    base_average = averages[base]
    names = _distinct(names, files)
    mismatched = problems(rows, base, names)
    if mismatched and not allow_mismatch:
        details = "; ".join(f"{names[i]!r}: {', '.join(issues)}" for i, issues in mismatched.items())
        raise IncomparableResultsError(
            f"These results cannot be compared with the baseline {names[base]!r}: {details}. Compare a model with "
            "its own pruned versions, evaluated with the same tokenizer and task versions; or pass "
            "allow_mismatch=True (CLI: --allow-mismatch) to print them marked, without a retained percentage."
        )
    sources = {name: column for name, column in columns.items()}
    counts = {name: [item_count(row, column.get("source", name)) for row in rows] for name, column in sources.items()}
    noisy = {name: min(c for c in values if c is not None) for name, values in counts.items()
             if any(c is not None for c in values) and min(c for c in values if c is not None) < noisy_items}

    header = ["Model", *(f"{name} †" if name in noisy else name for name in columns), "Average", "Retained (%)"]
    lines = ["| " + " | ".join(_cell(name) for name in header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
    any_stderr = False
    for index, (name, values, average) in enumerate(zip(names, table, averages)):
        retained = 100 * average / base_average if average is not None and base_average else None
        if index in mismatched:
            name, retained = f"{name} {MARK}", None
        formatted = []
        for column_name, value in zip(columns, values):
            if value is None:
                formatted.append(MISSING)
                continue
            column = columns[column_name]
            error = stderr_of(rows[index], column.get("source", column_name), column.get("metric", ""))
            if error is not None:
                any_stderr = True
                error = 100 * error if column.get("higher_is_better", True) else error
                formatted.append(f"{value:.{digits}f} ± {error:.{digits}f}")
            else:
                formatted.append(f"{value:.{digits}f}")
        formatted += [MISSING if average is None else f"{average:.{digits}f}",
                      MISSING if retained is None else f"{retained:.1f}"]
        lines.append("| " + " | ".join([_cell(name), *formatted]) + " |")
    notes = [
        f"Scores in %, except {', '.join(n for n, c in columns.items() if not c.get('higher_is_better', True))} (lower is better)"
        if any(not c.get("higher_is_better", True) for c in columns.values()) else "Scores in %",
        f"Average over {', '.join(averaged)}" if averaged else "No column is averaged",
        f"Retained: Average as a percentage of {_cell(names[base])}'s",
    ]
    if any_stderr:
        notes.append("± is lm-eval's standard error")
    for column_name, count in noisy.items():
        notes.append(f"† {_cell(column_name)}: {count} items (< {noisy_items}); a difference of "
                     f"{100 / count:.1f} points is one item, treat it as noise")
    for index, issues in mismatched.items():
        notes.append(f"{MARK} {_cell(names[index])} is not comparable with {_cell(names[base])}: "
                     f"{_cell(', '.join(issues))}")
    missing = [names[i] for i in unrecorded(rows)]
    if missing:
        notes.append(f"Base model or tokenizer not recorded for {', '.join(map(_cell, missing))} "
                     "(older results files): their comparability was not checked")
    return "\n".join(lines) + "\n\n" + ". ".join(notes) + ".\n"


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
    for index, summary in enumerate(summaries):
        if not (summary.get("model") or {}).get("pruning"):
            return index
    return 0


def report(results: list[str], output: str | None = None, baseline: str | None = None,
           labels: list[str] | None = None, digits: int = 2, allow_mismatch: bool = False,
           noisy_items: int = NOISY_ITEMS) -> str:
    """Print (and with ``output``, write) the Markdown table of evaluation result files.

    Args:
        results: Result JSON files written by ``ompmoe validate``/``test`` (LMEvalDataModule).
        output: Also write the table to this Markdown file.
        baseline: Label or row number of the original model (default: the first unpruned model).
        labels: Row labels instead of the files' own.
        digits: Decimals of the scores.
        allow_mismatch: Print rows of another base model, tokenizer or task version, marked.
        noisy_items: Flag columns of tasks with fewer items as noisy.
    """
    table = report_table(results, baseline=baseline, labels=labels, digits=digits, allow_mismatch=allow_mismatch,
                         noisy_items=noisy_items)
    if output is not None:
        from ..engine.io import atomic_path

        with atomic_path(output, overwrite=True) as tmp:
            tmp.write_text(table)
    print(table, end="")
    return table


def report_cli(argv: list[str] | None = None) -> str:
    """``ompmoe report RESULTS.json [RESULTS.json ...] [--output table.md] [--baseline LABEL|ROW]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="ompmoe report", description=report.__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="result JSON files of ompmoe validate/test (LMEvalDataModule)")
    parser.add_argument("--output", help="also write the table to this Markdown file")
    parser.add_argument("--baseline", help="label or row number of the original model (default: first unpruned)")
    parser.add_argument("--labels", nargs="+", help="row labels instead of the files' own")
    parser.add_argument("--digits", type=int, default=2, help="decimals of the scores")
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="print rows of another base model, tokenizer or task version (marked) instead of refusing")
    parser.add_argument("--noisy-items", type=int, default=NOISY_ITEMS,
                        help=f"flag tasks with fewer items as noisy (default {NOISY_ITEMS})")
    args = parser.parse_args(argv)
    try:
        return report(args.results, output=args.output, baseline=args.baseline, labels=args.labels,
                      digits=args.digits, allow_mismatch=args.allow_mismatch, noisy_items=args.noisy_items)
    except IncomparableResultsError as error:
        raise SystemExit(f"error: {error}") from None
