"""The paper's inference-cost table (Table 6) on ``shipped:tiny-moe``, through the lm-eval bridge, on CPU.

Run ``python benchmarks/inference_cost.py`` (about 5 minutes on one thread of a loaded 2-core
machine). Four models, each evaluated by ``ompmoe validate``'s own machinery (LMEvalDataModule +
EvalModule under a Lightning trainer, which record the cost in the results file):

- the original ``shipped:tiny-moe`` (float32, 6 MoE layers x 16 experts, top-4);
- OMP-MoE at 25 % and at 50 % of the routed experts pruned (the paper's method: ``omp`` with the
  ``waterfill`` cross-layer allocation), statistics from 16 x 256 tokens of the shipped calibration
  split (prose and code);
- the 50 % model with OMP-MoE+ adaptive skipping at epsilon 0.1 (the paper's setting).

Workload: the offline tasks shipped with the tests (``tests/eval_tasks``): ``tiny_group`` (28
multiple-choice questions, 4 answers: loglikelihood) and the ``wikitext2`` perplexity protocol
(rolling loglikelihood, windows of the model's 512 positions) on the shipped corpus' held-out
documents (``--ppl_docs`` per domain). Every model runs with the ``eager`` and the ``grouped_mm``
experts implementation, one CPU thread, ``--repeats`` times, all settings interleaved so background
load hits them alike. ``ompmoe report --cost-time cpu`` makes the tables (one per experts
implementation): a row is the run with its setting's median Cost, the process CPU time of that run's
evaluation loop (one pass over every batch, warm-up included; on a shared machine wall time mostly
measures the other jobs, with one thread and an idle machine the two agree). Speedup is not the ratio
of the Cost columns: after its loop each run times a probe (``EvalModule``'s defaults: up to 8 of its
batches evenly spaced over the length-sorted order, 1 untimed warm-up pass, then 5 timed passes;
``ompmoe.eval.timing``), and a row's Speedup is the median probe CPU time of the original's row (same
experts implementation) divided by the row's, with in parentheses the lowest and highest ratio of one
original repeat to one row repeat, or ``n.s.`` where that interval does not tell it apart from 1
(it includes 1, or its half-width is not smaller than the speedup's distance from 1). Under each
table: the ratio of the original's Cost to the model's in every repeat (each against the same
repeat's original, one loop pass each, not the probe), in CPU time and in wall-clock time (median
and min-max over the repeats).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import ompmoe
from ompmoe.data import corpus_documents, corpus_token_stream, shipped_model_path, token_blocks
from ompmoe.engine.apply.adaptive import adaptive_report, adaptive_totals, reset_adaptive_counters
from ompmoe.lightning.models import load_model

TASKS_DIR = Path(__file__).resolve().parents[1] / "tests" / "eval_tasks"
IMPLEMENTATIONS = ("eager", "grouped_mm")
SEQ_LEN = 256


def calibration_blocks(tokenizer) -> list[torch.Tensor]:
    """16 x 256 tokens of the shipped calibration split (8 prose, 8 code), in batches of 4."""
    blocks = torch.cat([token_blocks(corpus_token_stream(tokenizer, domain, "calibration", SEQ_LEN * 8), SEQ_LEN, 8)
                        for domain in ("prose", "code")])
    return list(blocks.split(4))


def models(ratios: list[float], epsilon: float) -> tuple[dict[str, torch.nn.Module], str]:
    """The original, its OMP-MoE prunings at ``ratios`` and the last one with OMP-MoE+ at ``epsilon``."""
    from transformers import AutoTokenizer

    path = str(shipped_model_path("tiny-moe"))
    original = load_model("shipped:tiny-moe").eval()
    stats = ompmoe.collect_stats(original, calibration_blocks(AutoTokenizer.from_pretrained(path)),
                                 model_id="shipped:tiny-moe")
    out = {"original": original}
    for ratio in ratios:
        plan = ompmoe.plan_pruning(stats, ratio, method="omp", allocation="waterfill")
        out[f"omp-{ratio:g}"] = ompmoe.prune(copy.deepcopy(original), plan)
    adaptive = copy.deepcopy(out[f"omp-{ratios[-1]:g}"])
    ompmoe.enable_adaptive(adaptive, stats, epsilon=epsilon)
    out[f"omp-{ratios[-1]:g}+adaptive"] = adaptive
    return out, path


def perplexity_file(directory: Path, docs: int) -> Path:
    """The first ``docs`` held-out documents of each domain as the rows of a WikiText-2-like json file."""
    rows = [doc["text"] for domain in ("prose", "code") for doc in corpus_documents(domain, "heldout")[:docs]]
    path = directory / "heldout.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))
    return path


def evaluate(model, datamodule, output: Path, implementation: str) -> dict:
    """One ``ompmoe validate`` run of ``model`` (its results file's ``ompmoe`` summary)."""
    import lightning.pytorch as pl

    from ompmoe.eval import EvalModule

    datamodule.output_path = str(output)
    module = EvalModule(model, tokenizer=datamodule.tokenizer, experts_implementation=implementation)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.validate(module, datamodule=datamodule, verbose=False)
    return json.loads(output.read_text())["ompmoe"]


def speedup_lines(runs: dict, implementation: str, names: list[str]) -> str:
    """Per model, the original's Cost divided by its own in each repeat (the evaluation loop's single pass, each vs
    the same repeat's original; not the table's probe-based Speedup): process CPU time (median, min-max) and wall
    clock (median, min-max)."""
    base = runs[(implementation, names[0])]
    lines = []
    for label, index in (("CPU time", 1), ("wall clock", 0)):
        parts = []
        for name in names[1:]:
            speedups = [b[index] / m[index] for b, m in zip(base, runs[(implementation, name)])]
            parts.append(f"{name} {statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f})")
        lines.append(f"Speedup in {label}, median (min-max) over repeats: {'; '.join(parts)}.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--ppl_docs", type=int, default=2, help="held-out documents per domain for perplexity")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--output_dir", default=None, help="keep the results files here (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    started = time.perf_counter()

    from ompmoe.eval import LMEvalDataModule
    from ompmoe.eval.report import report_table

    built, tokenizer = models(args.ratios, args.epsilon)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.output_dir or scratch)
        root.mkdir(parents=True, exist_ok=True)
        data = LMEvalDataModule(
            tasks=["tiny_group"], suites=["wikitext2"], include_path=str(TASKS_DIR), tokenizer=tokenizer,
            batch_size=args.batch_size, bootstrap_iters=0,
            dataset_overrides={"ompmoe_wikitext2_ppl": {
                "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(perplexity_file(root, args.ppl_docs))}}}},
        )
        data.build(tokenizer, config=built["original"].config)
        runs: dict[tuple[str, str], list[tuple[float, float, Path]]] = {}
        skipping: dict[str, dict[str, float]] = {}
        for repeat in range(args.repeats):
            for implementation in IMPLEMENTATIONS:
                for name, model in built.items():
                    reset_adaptive_counters(model)
                    output = root / f"{implementation}-{name}-{repeat}.json"
                    summary = evaluate(model, data, output, implementation)
                    runs.setdefault((implementation, name), []).append(
                        (summary["cost"]["seconds"], summary["cost"]["cpu_seconds"], output))
                    report = adaptive_report(model)
                    if report:
                        skipping[implementation] = adaptive_totals(report)
        cost = json.loads(runs[(IMPLEMENTATIONS[0], "original")][0][-1].read_text())["ompmoe"]["cost"]
        per_task = ", ".join(f"{task}: {entry['requests']} requests, {entry['tokens']} tokens"
                             for task, entry in cost["tasks"].items())
        print(f"Workload per run: {cost['requests']} lm-eval requests, {cost['tokens']} tokens ({per_task}); "
              f"{args.repeats} interleaved repeats per setting, 1 CPU thread, torch {torch.__version__}.\n")
        for implementation in IMPLEMENTATIONS:
            # The run with the median CPU time of each setting.
            medians = [sorted(runs[(implementation, name)], key=lambda run: run[1])[args.repeats // 2][-1]
                       for name in built]
            print(f"### `{implementation}` experts\n")
            print(report_table(medians, cost_time="cpu"))
            print(speedup_lines(runs, implementation, list(built)))
            if implementation in skipping:
                totals = skipping[implementation]
                print(f"OMP-MoE+ at epsilon {args.epsilon:g}: {totals['avg_experts_per_token']:.2f} of 4 experts per token "
                      f"and layer, skip ratio {totals['skip_ratio']:.3f} (last run).")
            print()
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
