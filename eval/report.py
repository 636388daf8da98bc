"""Markdown tables like the paper's Table 1 from evaluation result files.

Each results JSON written by :class:`ompmoe.eval.LMEvalDataModule` carries an ``ompmoe`` summary:
a label, the model (with its pruning record), and one score per report column. A table has one
row per file, one column per score (accuracies as percentages), the average of the primary
higher-is-better columns, and that average as a percentage of the original model's ("retained").
The original is the ``baseline`` file, else the first file of an unpruned model, else the first.
Perplexities are shown as they are and left out of averages.

``ompmoe report original.json omp-0.5.json reap-0.5.json [--output table.md]``
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MISSING = "–"


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


def report_table(results: Sequence[Mapping[str, Any] | str | Path], baseline: int | str | None = None,
                 labels: Sequence[str] | None = None, digits: int = 2) -> str:
    """The Markdown table of ``results`` (dicts or JSON paths), one row each, in order.

    Args:
        results: Result dicts or files from :class:`ompmoe.eval.LMEvalDataModule`.
        baseline: Row (index or label) whose average is 100% ("original"); default: the first
            unpruned model, else the first row.
        labels: Row labels instead of the files' own.
        digits: Decimals of the scores.
    """
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

    header = ["Model", *columns, "Average", "Retained (%)"]
    lines = ["| " + " | ".join(_cell(name) for name in header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
    for name, values, average in zip(names, table, averages):
        retained = 100 * average / base_average if average is not None and base_average else None
        formatted = [MISSING if v is None else f"{v:.{digits}f}" for v in values]
        formatted += [MISSING if average is None else f"{average:.{digits}f}",
                      MISSING if retained is None else f"{retained:.1f}"]
        lines.append("| " + " | ".join([_cell(name), *formatted]) + " |")
    notes = [
        f"Scores in %, except {', '.join(n for n, c in columns.items() if not c.get('higher_is_better', True))} (lower is better)"
        if any(not c.get("higher_is_better", True) for c in columns.values()) else "Scores in %",
        f"Average over {', '.join(averaged)}" if averaged else "No column is averaged",
        f"Retained: Average as a percentage of {_cell(names[base])}'s",
    ]
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
           labels: list[str] | None = None, digits: int = 2) -> str:
    """Print (and with ``output``, write) the Markdown table of evaluation result files.

    Args:
        results: Result JSON files written by ``ompmoe validate``/``test`` (LMEvalDataModule).
        output: Also write the table to this Markdown file.
        baseline: Label or row number of the original model (default: the first unpruned model).
        labels: Row labels instead of the files' own.
        digits: Decimals of the scores.
    """
    table = report_table(results, baseline=baseline, labels=labels, digits=digits)
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
    args = parser.parse_args(argv)
    return report(args.results, output=args.output, baseline=args.baseline, labels=args.labels, digits=args.digits)
