"""Throughput of the lm-eval bridge (LMEvalDataModule + EvalModule under Lightning) vs lm-eval's HFLM.

Run ``python benchmarks/eval_bridge.py`` (under 30 s on a 2-core CPU). Both sides evaluate the
same tiny random Qwen3-MoE (byte-level tokenizer) on the same local tasks, written to a temporary
directory: multiple choice (loglikelihood), generate-until with exact match, and rolling
loglikelihood (perplexity), with the same batch size, on one process and one CPU thread. Each side
runs once, end to end (task loading, request building, model work, scoring), in this process;
requests/s counts lm-eval requests (one per answer choice, generation or document). The metrics of
both sides are compared too.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

import torch

TASKS = ["bench_mc", "bench_gen", "bench_ppl"]

UTILS = '''
import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def load(name, **_):
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def mc(**kwargs):
    return load("mc.jsonl")


def gen(**kwargs):
    return load("gen.jsonl")


def ppl(**kwargs):
    return load("ppl.jsonl")
'''

YAML = {
    "bench_mc": """task: bench_mc
custom_dataset: !function bench_utils.mc
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{label}}"
doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    "bench_gen": """task: bench_gen
custom_dataset: !function bench_utils.gen
output_type: generate_until
test_split: test
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: " {{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
    "bench_ppl": """task: bench_ppl
custom_dataset: !function bench_utils.ppl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
""",
}


def write_tasks(directory: Path, mc_docs: int, gen_docs: int, ppl_docs: int) -> None:
    from ompmoe.data import shipped_text

    text = shipped_text()
    (directory / "bench_utils.py").write_text(UTILS)
    for name, body in YAML.items():
        (directory / f"{name}.yaml").write_text(body)
    words = text.split()
    mc = []
    for i in range(mc_docs):
        choices = [words[(7 * i + k) % len(words)] for k in range(4)]
        mc.append({"question": " ".join(words[i:i + 12]), "choices": choices, "label": i % 4})
    gen = [{"question": " ".join(words[3 * i:3 * i + 20]), "answer": words[3 * i + 20]} for i in range(gen_docs)]
    ppl = [{"text": text[600 * i:600 * i + 300 + 90 * (i % 9)]} for i in range(ppl_docs)]
    for name, rows in (("mc", mc), ("gen", gen), ("ppl", ppl)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def numeric(results: dict) -> dict:
    return {(task, key): value for task, metrics in results["results"].items() for key, value in metrics.items()
            if "," in key and isinstance(value, float)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--mc_docs", type=int, default=150)
    parser.add_argument("--gen_docs", type=int, default=40)
    parser.add_argument("--ppl_docs", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    import lightning.pytorch as pl
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from ompmoe.eval import EvalModule, LMEvalDataModule, byte_tokenizer
    from ompmoe.engine.tiny import tiny_model

    model = tiny_model("qwen3_moe")
    with tempfile.TemporaryDirectory() as tmp:
        write_tasks(Path(tmp), args.mc_docs, args.gen_docs, args.ppl_docs)

        start = time.perf_counter()
        data = LMEvalDataModule(tasks=TASKS, include_path=tmp, batch_size=args.batch_size, bootstrap_iters=0)
        module = EvalModule(model, tokenizer="bytes")
        trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.validate(module, datamodule=data, verbose=False)
        bridge_s = time.perf_counter() - start
        bridge = module.eval_results
        requests = bridge["config"]["work"]["requests"]

        start = time.perf_counter()
        lm = HFLM(pretrained=model, tokenizer=byte_tokenizer(), batch_size=args.batch_size, device="cpu")
        reference = simple_evaluate(model=lm, tasks=TASKS, bootstrap_iters=0,
                                    task_manager=TaskManager(include_path=tmp, include_defaults=False))
        hflm_s = time.perf_counter() - start

    work = bridge["config"]["work"]
    print(f"tiny qwen3_moe, {requests} lm-eval requests ({work['requests_loglikelihood']} loglikelihood, "
          f"{work['requests_generate_until']} generate_until, {work['requests_loglikelihood_rolling']} rolling "
          f"documents), batch size {args.batch_size}, 1 CPU thread, one run each, end to end")
    print(f"  {'':<34}{'seconds':>9}{'requests/s':>12}")
    print(f"  {'lm-eval simple_evaluate + HFLM':<34}{hflm_s:>9.2f}{requests / hflm_s:>12.1f}")
    print(f"  {'ompmoe bridge (Lightning)':<34}{bridge_s:>9.2f}{requests / bridge_s:>12.1f}")
    print(f"  bridge / HFLM throughput: {hflm_s / bridge_s:.2f}x   (request building {data.build_seconds:.2f} s; "
          f"{work['score_rows']} forward rows for {work['score_items']} scored items)")
    a, b = numeric(bridge), numeric(reference)
    same = all(abs(a[k] - v) <= 1e-6 * max(1.0, abs(v)) for k, v in b.items())
    print(f"  metrics equal: {same} ({len(b)} compared)")


if __name__ == "__main__":
    main()
