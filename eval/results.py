"""Scoring and writing an evaluation's results (the requests are built by :mod:`ompmoe.eval.datamodule`).

Rank 0 replays the responses to ``lm_eval.evaluator.evaluate`` on the very request objects ``build`` made,
adds the ``ompmoe`` summary that ``ompmoe report`` reads (label, model, scores, chance levels, cost)
and writes the results JSON.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from .comparability import tokenizer_fingerprint
from .cost import cost_record
from .requests import ROLLING, WorkPlan, make_replay_lm
from .suites import SETTINGS, Column, headline_columns


class SuiteRun(Protocol):
    """What scoring and writing read of the data module that built the requests (``LMEvalDataModule``, which
    imports this module: a protocol keeps the import one-way)."""

    limit: float | None
    batch_size: int
    groups: Sequence[Any]  # the data module's RequestGroup per suite
    plan: WorkPlan | None
    seeds: tuple[int | None, int | None, int | None]
    fewshot_random_seed: int | None
    bootstrap_iters: int
    tokenizer_: Any
    data_sources: dict[str, str]
    build_seconds: float
    label: str | None
    log_samples: bool
    system_instruction: str | None
    confirm_run_unsafe_code: bool
    output_path: str | None
    overwrite: bool

    def may_replace(self, target: Path) -> bool: ...

    def record_written(self, target: Path) -> None: ...


def score(data: SuiteRun, results: Mapping[int, Any], model_info: Mapping[str, Any] | None = None,
          cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """lm-eval results from every work item's result (all ranks' results merged); ``cost``: the run's
    ``seconds``, ``items`` ({item: (seconds, tokens)}) and settings, recorded as ``ompmoe.cost``."""
    if data.plan is None:
        raise RuntimeError("Nothing to score: setup() has not run.")
    responses = [
        data.groups[request.group].encoder.decode_generation(value, request.generation_until)
        if request.generation_until is not None else value
        for request, value in zip(data.plan.requests, data.plan.responses(results))
    ]
    return evaluate_responses(data, responses, model_info, cost)


def evaluate_responses(data: SuiteRun, responses: Sequence[Any], model_info: Mapping[str, Any] | None = None,
                       cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Hand one response per request (``plan.requests`` order) to lm-eval to filter, score and aggregate."""
    from lm_eval.evaluator import evaluate

    from .humaneval import allow_execution

    requests = data.plan.requests
    if len(responses) != len(requests):
        raise ValueError(f"Expected {len(requests)} responses, got {len(responses)}.")
    merged: dict[str, Any] = {}
    for index, group in enumerate(data.groups):
        queues: dict[int, list[Any]] = defaultdict(list)
        for request, response in zip(requests, responses):
            if request.group == index:
                queues[id(request.instance)].append(response)
        for task in group.loaded["tasks"].values():
            for instance in task.instances:  # a second scoring starts clean
                instance.resps = []
                instance.filtered_resps = {}
        with allow_execution() if data.confirm_run_unsafe_code else nullcontext():
            out = evaluate(
                lm=make_replay_lm(queues), task_dict=group.loaded, limit=data.limit,
                bootstrap_iters=data.bootstrap_iters, log_samples=data.log_samples,
                system_instruction=data.system_instruction,
                apply_chat_template=bool(group.suite.apply_chat_template),
                fewshot_as_multiturn=group.suite.fewshot_as_multiturn,
                confirm_run_unsafe_code=data.confirm_run_unsafe_code,
            )
        for key, value in out.items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    _add_token_perplexity(data, merged, responses)
    merged["config"] = _config(data, model_info)
    merged["ompmoe"] = _summary(data, merged, model_info)
    if cost is not None:
        settings = {key: value for key, value in cost.items() if key not in ("seconds", "items")}
        merged["ompmoe"]["cost"] = cost_record(requests, cost["items"], cost["seconds"],
                                               build_seconds=data.build_seconds, **settings)
    return merged


def _add_token_perplexity(data: SuiteRun, results: dict[str, Any], responses: Sequence[Any]) -> None:
    """``token_perplexity`` of rolling-loglikelihood tasks: exp(-sum log p / predicted tokens)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for request, response in zip(data.plan.requests, responses):
        if request.instance.request_type == ROLLING:
            total = totals[request.instance.task_name]
            total[0] += float(response)
            total[1] += request.num_tokens
    for task, (logprob, tokens) in totals.items():
        if task in results.get("results", {}) and tokens:
            results["results"][task]["token_perplexity,none"] = math.exp(-logprob / tokens)
            results["results"][task]["token_perplexity_stderr,none"] = "N/A"
            results.setdefault("higher_is_better", {}).setdefault(task, {})["token_perplexity"] = False


def _config(data: SuiteRun, model_info: Mapping[str, Any] | None) -> dict[str, Any]:
    import lm_eval

    return {
        "model": dict(model_info or {}).get("model"),
        "evaluator": "ompmoe.eval.LMEvalDataModule",
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "limit": data.limit,
        "batch_size": data.batch_size,
        "max_length": {group.name: group.encoder.max_length for group in data.groups},
        "bootstrap_iters": data.bootstrap_iters,
        "random_seed": data.seeds[0],
        "numpy_seed": data.seeds[1],
        "torch_seed": data.seeds[2],
        "fewshot_seed": data.fewshot_random_seed,
        "tokenizer": str(getattr(data.tokenizer_, "name_or_path", data.tokenizer_)),
        "tokenizer_fingerprint": tokenizer_fingerprint(data.tokenizer_),
        "data_sources": dict(data.data_sources),
        "work": data.plan.counts() if data.plan is not None else {},
        "date": time.time(),
        "platform": platform.platform(),
    }


def _summary(data: SuiteRun, results: dict[str, Any], model_info: Mapping[str, Any] | None) -> dict[str, Any]:
    info = dict(model_info or {})
    suites: dict[str, Any] = {}
    columns: list[Column] = []
    for suite in (group.suite for group in data.groups):
        group_columns = list(suite.columns)
        if not group_columns:  # the tasks given by name: each its headline metric
            for spec in suite.tasks:
                name = Path(spec).stem if os.path.exists(spec) else spec
                group_columns += headline_columns(name, _metrics_of(results, name),
                                                  results.get("higher_is_better", {}).get(name))
        scores = {column.name: _metrics_of(results, column.source).get(column.metric) for column in group_columns}
        settings = copy.deepcopy({key: getattr(suite, key) for key in SETTINGS})
        suites[suite.name] = {
            "scores": scores,
            "average": _average(group_columns, scores),
            "settings": {**settings, "tasks": list(suite.tasks)},
            "description": suite.description,
        }
        columns += group_columns
    scores = {column.name: _metrics_of(results, column.source).get(column.metric) for column in columns}
    chance = _chance_levels(data, results)
    return {
        "label": data.label or info.get("label") or info.get("model") or "model",
        "model": info,
        "columns": [{**asdict(column), "chance": chance.get(column.source)} for column in columns],
        "scores": scores,
        "average": _average(columns, scores),
        "suites": suites,
    }


def _chance_levels(data: SuiteRun, results: Mapping[str, Any]) -> dict[str, float]:
    """Accuracy of guessing per multiple choice task (mean of 1 / choices) and group (size-weighted);
    the report leaves out tasks no model beats it on."""
    levels: dict[str, tuple[float, int]] = {}  # name -> (chance, items)
    for group in data.groups:
        for name, task in (group.loaded or {}).get("tasks", {}).items():
            if task.get_config("output_type") != "multiple_choice":
                continue
            docs = {instance.doc_id: instance.doc for instance in task.instances}
            choices = [len(task.doc_to_choice(doc)) for doc in docs.values()]
            if choices and all(choices):
                levels[name] = sum(1 / count for count in choices) / len(choices), len(choices)
    subtasks = results.get("group_subtasks") or {}

    def level(name: str) -> tuple[float, int] | None:
        if name in levels:
            return levels[name]
        parts = [level(task) for task in subtasks.get(name, [])]
        if not parts or any(part is None for part in parts):
            return None
        size = sum(part[1] for part in parts)
        return sum(part[0] * part[1] for part in parts) / size, size

    for name in subtasks:
        found = level(name)
        if found is not None:
            levels[name] = found
    return {name: chance for name, (chance, _) in levels.items()}


def _metrics_of(results: Mapping[str, Any], name: str) -> dict[str, Any]:
    for section in ("results", "groups"):
        metrics = (results.get(section) or {}).get(name)
        if metrics:
            return metrics
    return {}


def _average(columns: Sequence[Column], scores: Mapping[str, Any]) -> float | None:
    values = [scores.get(column.name) for column in columns if column.primary and column.higher_is_better]
    values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(values) / len(values) if values else None


def flat_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """Numeric metrics for the trainer's logger: ``task/metric[/filter]``, suite and overall averages."""
    flat: dict[str, float] = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                if "," not in key or "_stderr" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                metric, filter_name = key.split(",", 1)
                flat[f"{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")] = float(value)
    summary = results.get("ompmoe") or {}
    for suite, entry in (summary.get("suites") or {}).items():
        if entry.get("average") is not None:
            flat[f"{suite}/average"] = float(entry["average"])
    if summary.get("average") is not None:
        flat["average"] = float(summary["average"])
    return flat


def write(data: SuiteRun, results: Mapping[str, Any], path: str | os.PathLike | None = None) -> Path | None:
    """Write ``results`` as JSON, atomically, to ``path`` or ``data.output_path`` (a directory gets
    ``results.json``); returns the file. An existing file is replaced only with ``data.overwrite`` or when ``data``
    wrote it itself (``setup`` refused any other before any work; this keeps one that appeared meanwhile)."""
    from lm_eval.utils import handle_non_serializable

    from ..engine.io import atomic_path

    target = results_file(path or data.output_path)
    if target is None:
        return None
    with atomic_path(target, overwrite=data.may_replace(target)) as tmp:
        tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    data.record_written(target)
    return target


def results_file(output_path: str | os.PathLike | None) -> Path | None:
    """The results JSON of ``output_path``: the path itself, or ``results.json`` in it when it is a directory (an
    existing one, or a path ending in ``/``); ``None`` without an ``output_path``."""
    if output_path is None:
        return None
    directory = Path(output_path).is_dir() or os.fspath(output_path).endswith(os.sep)
    return Path(output_path) / "results.json" if directory else Path(output_path)


def check_results_output(output_path: str | os.PathLike | None, overwrite: bool, inputs: Sequence[Any] = ()
                         ) -> Path | None:
    """The results file of ``output_path``, checked before any work (``ompmoe validate`` / ``test`` call this before
    the model is built): an existing file is refused without ``overwrite`` (``OutputExistsError``, naming the file
    and ``--overwrite``), and so are an unwritable place and another live run writing it
    (:func:`ompmoe.engine.io.check_writable`). ``inputs``: paths the run reads, never replaced."""
    from ..engine.io import check_writable, local_inputs

    target = results_file(output_path)
    if target is not None:
        check_writable(target, overwrite, directory=False, inputs=local_inputs(*inputs))
    return target
