"""The paper's suites end to end on local fixtures, through ``ompmoe validate`` / ``ompmoe test``.

The hub data sets cannot be reached here, so ``tests/make_eval_fixtures.py`` writes small copies in
each data set's own schema (hub-snapshot layout). The suites run through the user's entry point,
``ompmoe.cli.main(["validate" | "test", ...])``, reading the copies with ``--data.data_dir`` or
``--data.dataset_overrides``, with lm-eval's task YAMLs unchanged: prompt templates,
``process_docs``, filters, regexes, group aggregation, LongBench's metric packages and HumanEval's
sandboxed execution all run. Every metric, and every generated sample (prompt, stop sequences,
``max_gen_toks``, raw and filtered response), must equal ``lm_eval.simple_evaluate`` with ``HFLM``
on the same fixtures and model (``shipped:tiny-moe``); hand-written right and wrong responses must
score 1 and 0 through the real filters and metrics. Chat templates (``apply_chat_template``,
``fewshot_as_multiturn``, ``system_instruction``, ``chat_template_args``) are exercised with a copy of
the shipped tokenizer that has one.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from ompmoe.cli import main  # noqa: E402
from ompmoe.data import resolve_shipped  # noqa: E402
from ompmoe.eval import SUITES, LMEvalDataModule  # noqa: E402
from ompmoe.eval.suites import TASKS_DIR  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import make_eval_fixtures as fixtures  # noqa: E402

MODEL = "shipped:tiny-moe"
SUITE_NAMES = ("zeroshot8", "gsm8k", "bbh", "longbench")
GENERATIVE = ("gsm8k", "bbh", "longbench")
LIMIT = 1  # documents per task (MMLU: per subject, 57; BBH: per subtask, 27; LongBench: per data set, 21)
MAX_LENGTH = 1024  # the tiny model's 512 positions leave no context for LongBench's 512-token summaries
CHAT_LIMIT = 2  # HumanEval problems and GSM8K documents of the chat-template run
CHAT_MAX_LENGTH = 2048  # HumanEval asks for 1024 new tokens; RoPE positions go past the trained 512
MAX_GEN_TOKS = 64  # new tokens for tasks that set none (gsm8k, bbh; HFLM's default is 256): fixture-sized
BATCH_SIZE = 8
DTYPE = "float32"  # the shipped weights are bf16; in float32 the bridge equals HFLM exactly (docs of LMEvalDataModule)
SYSTEM = "You are a careful assistant."
NO_THINKING = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' and loop.last %}" + NO_THINKING + "{% endif %}"
    "{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n" + NO_THINKING + "{% endif %}"
)
"""Qwen3's shape in miniature: with ``enable_thinking=False`` (HumanEval's chat_template_args) the answer being
written (the generation prompt, or a last assistant message that ``gen_prefix`` opens) starts with an empty think
block."""
SAMPLE_FIELDS = ("doc_id", "target", "arguments", "resps", "filtered_resps", "filter", "metrics")


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch

pytestmark = pytest.mark.slow  # the real lm-eval suites: minutes on 2 CPU cores


@pytest.fixture(scope="module")
def data_root(tmp_path_factory, monkeypatch_module) -> Path:
    """The fixture data sets, read through a fresh datasets cache (no stale schema from another run)."""
    import datasets.config

    root = fixtures.write_all(tmp_path_factory.mktemp("hub"))
    monkeypatch_module.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets-cache"))
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    return root


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """The shipped tokenizer with a chat template (the shipped model has none), saved as a directory."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_shipped(MODEL))
    tokenizer.chat_template = CHAT_TEMPLATE
    directory = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def _hub_from(root: Path) -> Iterator[None]:
    """For the reference run: ``datasets.load_dataset("<owner>/<name>", ...)`` reads ``root/<owner>/<name>``."""
    import datasets

    original = datasets.load_dataset

    def load_dataset(path: str, *args, **kwargs):
        local = root / path
        return original(str(local) if local.is_dir() else path, *args, **kwargs)

    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = original


def _numeric(results: dict) -> dict[tuple[str, str], float]:
    return {
        (task, key): value
        for section in ("results", "groups")
        for task, metrics in (results.get(section) or {}).items()
        for key, value in metrics.items()
        if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def _samples(results: dict, tasks: set[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per task, lm-eval's logged samples (the fields both evaluators fill), as JSON would store them."""
    from lm_eval.utils import handle_non_serializable

    samples = json.loads(json.dumps(results.get("samples") or {}, default=handle_non_serializable))
    return {task: sorted(([{key: sample.get(key) for key in SAMPLE_FIELDS} for sample in rows]),
                         key=lambda s: (s["doc_id"], s["filter"]))
            for task, rows in samples.items() if tasks is None or task in tasks}


class Run:
    """One ``ompmoe validate``/``test`` run: its results JSON, and the datamodule and raw model outputs it scored."""

    def __init__(self, results: dict, data: LMEvalDataModule, raw: dict[int, Any]) -> None:
        self.results, self.data, self.raw = results, data, raw


def _cli(subcommand: str, output: Path, *args: str) -> Run:
    """``ompmoe <subcommand>`` in process; records (does not change) the datamodule and what it scored."""
    recorded: dict[str, Any] = {}
    score = LMEvalDataModule.score

    def recording_score(self, results, model_info=None, **kwargs):
        recorded["data"], recorded["raw"] = self, dict(results)
        return score(self, results, model_info, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LMEvalDataModule, "score", recording_score)
        main([subcommand, "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.devices", "1",
              "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(output.parent),
              "--model.model", MODEL, "--model.dtype", DTYPE, "--data.batch_size", str(BATCH_SIZE),
              "--data.bootstrap_iters", "0", "--data.log_samples", "true", "--data.output_path", str(output),
              "--model.timing_repeats", "0", *args])  # no timing probe: tests/eval/test_eval.py tests it
    return Run(json.loads(output.read_text()), recorded["data"], recorded["raw"])


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory) -> dict[str, Run]:
    """The four suites as a user runs them: ``ompmoe validate`` with ``--data.data_dir`` (zeroshot8, gsm8k,
    bbh) and ``ompmoe test`` with ``--data.dataset_overrides`` (longbench), each suite with its own settings."""
    out = tmp_path_factory.mktemp("cli")
    validate = _cli("validate", out / "validate.json", "--data.suites", "[zeroshot8, gsm8k, bbh]",
                    "--data.data_dir", str(data_root), "--data.limit", str(LIMIT), "--data.max_length", str(MAX_LENGTH),
                    "--data.max_gen_toks", str(MAX_GEN_TOKS))
    overrides = json.dumps({"Xnhyacinth/LongBench": str(data_root / "Xnhyacinth" / "LongBench")})
    test = _cli("test", out / "test.json", "--data.suites", "[longbench]", "--data.dataset_overrides", overrides,
                "--data.limit", str(LIMIT), "--data.max_length", str(MAX_LENGTH))
    return {"zeroshot8": validate, "gsm8k": validate, "bbh": validate, "longbench": test}


def _hflm(**kwargs: Any) -> Any:
    """``HFLM`` whose default generation length is :data:`MAX_GEN_TOKS` (``--data.max_gen_toks``; HFLM fixes 256)."""
    from lm_eval.models.huggingface import HFLM

    class FixtureHFLM(HFLM):
        @property
        def max_gen_toks(self) -> int:
            return MAX_GEN_TOKS

    return FixtureHFLM(**kwargs)


@pytest.fixture(scope="module")
def reference(data_root) -> dict[str, dict]:
    """``lm_eval.simple_evaluate`` with ``HFLM`` per suite, on the same fixtures, model and settings."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    path = resolve_shipped(MODEL)
    lm = _hflm(pretrained=path, tokenizer=path, batch_size=BATCH_SIZE, device="cpu", max_length=MAX_LENGTH,
               dtype=DTYPE)
    manager = TaskManager()
    out = {}
    with _hub_from(data_root):
        for name in SUITE_NAMES:
            suite = SUITES[name]
            out[name] = simple_evaluate(model=lm, tasks=list(suite.tasks), num_fewshot=suite.num_fewshot, limit=LIMIT,
                                        bootstrap_iters=0, task_manager=manager, log_samples=True)
    return out


@pytest.fixture(scope="module")
def chat_run(data_root, chat_tokenizer, tmp_path_factory) -> Run:
    """``humaneval`` (chat template, ``enable_thinking=False``, 1024 new tokens, sandboxed execution) and 5-shot
    ``gsm8k`` as chat turns with a system prompt, in one ``ompmoe validate``."""
    out = tmp_path_factory.mktemp("chat")
    return _cli("validate", out / "chat.json", "--model.tokenizer", str(chat_tokenizer), "--data.suites", "[humaneval]",
                "--data.tasks", "[gsm8k]", "--data.num_fewshot", "5", "--data.apply_chat_template", "true",
                "--data.fewshot_as_multiturn", "true", "--data.system_instruction", SYSTEM,
                "--data.confirm_run_unsafe_code", "true", "--data.data_dir", str(data_root),
                "--data.limit", str(CHAT_LIMIT), "--data.max_length", str(CHAT_MAX_LENGTH),
                "--data.max_gen_toks", str(MAX_GEN_TOKS))


@pytest.fixture(scope="module")
def chat_reference(data_root, chat_tokenizer) -> dict[str, dict]:
    """The same two evaluations with ``simple_evaluate`` + ``HFLM`` (HumanEval's ``chat_template_args`` on its HFLM)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from ompmoe.eval.humaneval import allow_execution

    path = resolve_shipped(MODEL)
    common = dict(pretrained=path, tokenizer=str(chat_tokenizer), batch_size=BATCH_SIZE, device="cpu",
                  max_length=CHAT_MAX_LENGTH, dtype=DTYPE)
    humaneval = SUITES["humaneval"]
    manager = TaskManager(include_path=str(TASKS_DIR))
    settings = dict(limit=CHAT_LIMIT, apply_chat_template=True, fewshot_as_multiturn=True, system_instruction=SYSTEM,
                    bootstrap_iters=0, task_manager=manager, log_samples=True)
    with _hub_from(data_root), allow_execution():
        return {
            "humaneval": simple_evaluate(model=_hflm(**common, chat_template_args=dict(humaneval.chat_template_args)),
                                         tasks=list(humaneval.tasks), num_fewshot=humaneval.num_fewshot,
                                         gen_kwargs=dict(humaneval.gen_kwargs), confirm_run_unsafe_code=True, **settings),
            "gsm8k": simple_evaluate(model=_hflm(**common), tasks=["gsm8k"], num_fewshot=5, **settings),
        }


# ------------------------------------------------------------------------------------------------ fixtures and schemas
def test_fixtures_keep_the_hub_schemas_and_every_task_reads_its_copy(runs, data_root):
    import datasets

    sources = {**runs["zeroshot8"].data.data_sources, **runs["longbench"].data.data_sources}
    assert len([t for t in sources if t.startswith("mmlu_")]) == 57
    assert len([t for t in sources if t.startswith("bbh_zeroshot_")]) == 27
    assert len([t for t in sources if t.startswith("longbench_")]) == 21
    assert len(sources) == 57 + 7 + 1 + 27 + 21
    assert all(source.startswith(str(data_root)) for source in sources.values()), sources
    # Column names and types as on the hub (the ones lm-eval's YAMLs and utils read).
    arc = datasets.load_dataset(str(data_root / "allenai/ai2_arc"), "ARC-Challenge")
    assert set(arc) == {"train", "validation", "test"}
    assert arc["test"].features["choices"] == {"text": datasets.List(datasets.Value("string")),
                                               "label": datasets.List(datasets.Value("string"))}
    hellaswag = datasets.load_dataset(str(data_root / "Rowan/hellaswag"))["validation"]
    assert hellaswag.features["label"] == datasets.Value("string") and hellaswag.features["ind"] == datasets.Value("int64")
    mmlu = datasets.load_dataset(str(data_root / "cais/mmlu"), "virology")
    assert set(mmlu) == {"test", "validation", "dev"} and mmlu["test"].features["answer"] == datasets.Value("int64")


def test_fixture_script_writes_a_snapshot_tree(tmp_path):
    root = fixtures.write_all(tmp_path)
    readme = (root / "cais" / "mmlu" / "README.md").read_text()
    assert readme.count("- config_name: ") == 57 and "  - split: dev\n    path: virology/dev.jsonl" in readme
    assert sorted(p.name for p in (root / "SaylorTwift" / "bbh").iterdir() if p.is_dir()) == sorted(fixtures.BBH_SUBTASKS)
    assert fixtures.write_all(tmp_path / "again").joinpath("openai/gsm8k/main/test.jsonl").read_text() == (
        root / "openai/gsm8k/main/test.jsonl").read_text()


# ------------------------------------------------------------------------------------------------ equality with HFLM
def _assert_metrics_equal(expected_results: dict, actual_results: dict) -> None:
    expected, actual = _numeric(expected_results), _numeric(actual_results)
    assert expected
    for key, value in expected.items():
        assert key in actual, key
        assert actual[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def _assert_samples_equal(expected_results: dict, actual_results: dict) -> None:
    """Every generated sample: prompt, generation kwargs (stops, max_gen_toks), raw and filtered responses, scores."""
    expected = _samples(expected_results)
    actual = _samples(actual_results, set(expected))
    assert expected and actual.keys() == expected.keys()
    for task, rows in expected.items():
        assert actual[task] == rows, task


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_suite_metrics_equal_simple_evaluate_with_hflm(runs, reference, name):
    results = runs[name].results
    _assert_metrics_equal(reference[name], results)
    for column in SUITES[name].columns:  # every reported metric of the suite is produced
        section = "groups" if column.source in results.get("groups", {}) else "results"
        assert isinstance(results[section][column.source][column.metric], float), column
    assert results["ompmoe"]["scores"].keys() >= {column.name for column in SUITES[name].columns}
    assert results["ompmoe"]["model"]["stage"] == ("test" if name == "longbench" else "validate")


@pytest.mark.parametrize("name", GENERATIVE)
def test_generated_samples_equal_hflms(runs, reference, name):
    _assert_samples_equal(reference[name], runs[name].results)


def test_group_aggregation_is_lm_evals(runs):
    """MMLU is size-weighted over its subjects; LongBench (weight_by_size: False) is the plain mean of its 21
    data sets' scores (lm-eval flattens the six categories), not the mean of the category means."""
    results = runs["zeroshot8"].results
    per = results["results"]
    subjects = [t for t in per if t.startswith("mmlu_")
                and t not in ("mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities")]
    assert len(subjects) == 57
    assert results["groups"]["mmlu"]["acc,none"] == pytest.approx(sum(per[t]["acc,none"] for t in subjects) / 57)
    longbench = runs["longbench"].results
    categories = ("longbench_code", "longbench_fewshot", "longbench_multi", "longbench_single",
                  "longbench_summarization", "longbench_synthetic")
    leaves = [metrics["score,none"] for task, metrics in longbench["results"].items()
              if task.startswith("longbench_") and task not in categories]
    assert len(leaves) == 21
    assert longbench["groups"]["longbench"]["score,none"] == pytest.approx(sum(leaves) / 21)


# ------------------------------------------------------------------------------------------------ stops and lengths
def _generations(run: Run) -> list[dict[str, Any]]:
    """Each generate request of a run: its task, stop sequences, ``max_gen_toks`` and what the model produced."""
    data = run.data
    specs = {int(item): (batch["until"], batch["max_gen_toks"]) for batch in data.batches if batch["kind"] == "generate"
             for item in batch["items"].tolist()}
    out = []
    for request in data.plan.requests:
        if request.generation_until is None:
            continue
        item = request.items[0]
        until, max_gen_toks = specs[item]
        tokens = list(run.raw[item])
        text = data.tokenizer_.decode(tokens)  # special tokens kept: EOS is a stop sequence too
        out.append({"task": request.instance.task_name, "suite": data.groups[request.group].name, "until": until,
                    "max_gen_toks": max_gen_toks, "tokens": tokens, "text": text,
                    "response": data.groups[request.group].encoder.decode_generation(tokens, until),
                    "stopped": any(stop in text for stop in until)})
    return out


def _check_lengths_and_stops(generations: list[dict[str, Any]]) -> None:
    for g in generations:
        assert len(g["tokens"]) <= g["max_gen_toks"], g["task"]
        if not g["stopped"]:  # only a stop sequence ends a row before max_gen_toks
            assert len(g["tokens"]) == g["max_gen_toks"], g["task"]
        assert not any(stop in g["response"] for stop in g["until"]), g["task"]


EOS = "<|endoftext|>"  # the shipped tokenizer's EOS; lm-eval adds it to every task's stop sequences
STOPS = {
    "gsm8k": ["Question:", "</s>", "<|im_end|>", EOS],
    "bbh": ["</s>", "Q:", "<|im_end|>", EOS],
    "humaneval": ["\nclass", "\ndef", "\n#", "\nif", "\nprint", EOS],
}


@pytest.mark.parametrize("name", GENERATIVE)
def test_generation_suites_stop_at_their_stop_sequences_and_max_gen_toks(runs, name):
    generations = [g for g in _generations(runs[name]) if g["suite"] == name]
    assert len(generations) == {"gsm8k": 1, "bbh": 27, "longbench": 21}[name]
    if name == "longbench":  # each data set's own length and stops
        by_task = {g["task"]: g for g in generations}
        assert by_task["longbench_gov_report"]["max_gen_toks"] == 512
        assert by_task["longbench_hotpotqa"]["max_gen_toks"] == 32
        assert by_task["longbench_trec"]["until"] == ["\n", EOS]
        assert by_task["longbench_lcc"]["max_gen_toks"] == 64
    else:  # --data.max_gen_toks (the task YAMLs set none), as HFLM(max_gen_toks=...)
        assert all(g["until"] == STOPS[name] and g["max_gen_toks"] == MAX_GEN_TOKS for g in generations)
    if name == "gsm8k":
        context = next(r.instance.args[0] for r in runs[name].data.plan.requests if r.instance.task_name == "gsm8k")
        assert context.count("Question:") == 6 and context.count("#### ") == 5  # 5 shots from the train split
    _check_lengths_and_stops(generations)
    if name == "longbench":  # both ways a generation ends occur with the shipped model: a "\n" stop, and the length
        assert {g["task"] for g in generations if g["stopped"]} >= {"longbench_trec", "longbench_lsht"}
        assert len(by_task["longbench_gov_report"]["tokens"]) == 512
    else:  # the shipped model never writes "Question:"/"Q:" here: every row runs to max_gen_toks
        assert all(len(g["tokens"]) == MAX_GEN_TOKS for g in generations)


def test_default_generation_length_is_hflms():
    from lm_eval.models.huggingface import HFLM

    default = HFLM.max_gen_toks.fget(None)
    assert default == 256 and LMEvalDataModule(suites=["gsm8k"]).max_gen_toks == default


def _stub(data: LMEvalDataModule, right: bool) -> dict:
    """Score a fixed response per generation request (a stub model) through the tasks' real filters and metrics."""
    responses = [fixtures.ANSWERS[request.instance.task_name][0 if right else 1]
                 if request.instance.request_type == "generate_until" else (0.0, True)
                 for request in data.plan.requests]
    return _numeric(data.evaluate_responses(responses))


def _stub_tokens(run: Run, answer) -> dict:
    """Score made-up model output tokens (``answer(request, until)``) through decoding, stops, filters and metrics."""
    data = run.data
    raw: dict[int, Any] = {item: (0.0, True) for item in range(len(data.plan.items))}
    for g, request in zip(_generations(run), [r for r in data.plan.requests if r.generation_until is not None]):
        raw[request.items[0]] = answer(request, g["until"])
    return _numeric(data.score(raw))


def _keys(data: LMEvalDataModule, name: str) -> list[tuple[str, str]]:
    tasks = sorted({r.instance.task_name for r in data.plan.requests if data.groups[r.group].name == name})
    if name == "gsm8k":
        keys = [("gsm8k", "exact_match,strict-match"), ("gsm8k", "exact_match,flexible-extract")]
    elif name == "bbh":
        keys = [(task, f"exact_match,{f}") for task in tasks for f in ("strict-match", "flexible-extract")]
        keys.append(("bbh_zeroshot", "exact_match,flexible-extract"))
    else:
        keys = [(task, "score,none") for task in tasks] + [("longbench", "score,none")]
    assert len(keys) == {"gsm8k": 2, "bbh": 55, "longbench": 22}[name]
    return keys


@pytest.mark.parametrize("name", GENERATIVE)
def test_right_answers_score_one_and_wrong_answers_zero(runs, name):
    data = runs[name].data
    right, wrong = _stub(data, True), _stub(data, False)
    for key in _keys(data, name):
        assert right[key] == pytest.approx(1.0, abs=1e-6), key
        assert wrong[key] == 0.0, key


@pytest.mark.parametrize("name", GENERATIVE)
def test_output_after_a_stop_sequence_is_cut_before_scoring(runs, name):
    """Model output ``right + stop + wrong`` scores as ``right`` (1); for tasks whose only stop is EOS, ``right``
    then EOS and padding scores 1 (the special tokens are dropped, as HFLM decodes)."""
    run = runs[name]
    tokenizer = run.data.tokenizer_

    def answer(request, until: list[str]) -> list[int]:
        right, wrong = fixtures.ANSWERS[request.instance.task_name]
        stop = until[0]
        if stop == EOS:  # EOS then padding (EOS again), as generate() leaves a finished row
            return tokenizer.encode(right, add_special_tokens=False) + [tokenizer.eos_token_id] * 3
        return tokenizer.encode(right + stop + " " + wrong, add_special_tokens=False)

    scores = _stub_tokens(run, answer)
    for key in _keys(run.data, name):
        assert scores[key] == pytest.approx(1.0, abs=1e-6), key


# ------------------------------------------------------------------------------------------------ chat and HumanEval
@pytest.mark.parametrize("name", ["humaneval", "gsm8k"])
def test_chat_template_runs_equal_hflms(chat_run, chat_reference, name):
    _assert_metrics_equal(chat_reference[name], chat_run.results)
    _assert_samples_equal(chat_reference[name], chat_run.results)


def test_chat_template_prompts(chat_run, chat_tokenizer):
    contexts = {}
    for request in chat_run.data.plan.requests:
        contexts.setdefault(request.instance.task_name, []).append(request.instance.args[0])
    assert len(contexts["gsm8k"]) == len(contexts["ompmoe_humaneval_instruct"]) == CHAT_LIMIT
    for context in contexts["gsm8k"]:  # fewshot_as_multiturn: 5 question/answer turns, then the question
        assert context.startswith(f"<|system|>\n{SYSTEM}\n<|user|>\nQuestion:")
        assert context.count("<|user|>\n") == 6 and context.count("<|assistant|>\n") == 6
        assert context.endswith("\nAnswer:\n<|assistant|>\n") and "<think>" not in context
    from ompmoe.eval.humaneval import problems

    for context, problem in zip(contexts["ompmoe_humaneval_instruct"], problems()):
        # chat_template_args {"enable_thinking": False} reach the template; gen_prefix opens the function.
        assert context.startswith(f"<|system|>\n{SYSTEM}\n<|user|>\nWrite a solution")
        assert context.endswith("<|assistant|>\n<think>\n\n</think>\n\nHere is the completed function:\n```python\n"
                                + problem["prompt"] + "\n")


def test_humaneval_generations_stop_and_run_in_the_sandbox(chat_run):
    generations = _generations(chat_run)
    humaneval = [g for g in generations if g["task"] == "ompmoe_humaneval_instruct"]
    assert len(humaneval) == CHAT_LIMIT
    assert all(g["until"] == STOPS["humaneval"] and g["max_gen_toks"] == 1024 for g in humaneval)
    gsm8k = [g for g in generations if g["task"] == "gsm8k"]
    assert all(g["until"] == STOPS["gsm8k"] and g["max_gen_toks"] == MAX_GEN_TOKS for g in gsm8k)
    _check_lengths_and_stops(generations)
    # Both ways a generation ends occur here: the shipped model opens a new "\ndef" at once in HumanEval (a stop
    # sequence; its own max_gen_toks, 1024, stays), and runs GSM8K-as-chat to --data.max_gen_toks.
    assert all(g["stopped"] and len(g["tokens"]) < 1024 for g in humaneval)
    assert all(not g["stopped"] and len(g["tokens"]) == MAX_GEN_TOKS for g in gsm8k)
    # The sandbox ran each program (prompt + completion + tests): an empty body fails.
    samples = chat_run.results["samples"]["ompmoe_humaneval_instruct"]
    assert len(samples) == CHAT_LIMIT
    assert all(len(s["filtered_resps"]) == 1 and s["filtered_resps"][0][0].startswith("failed") for s in samples), samples
    assert chat_run.results["results"]["ompmoe_humaneval_instruct"]["pass@1,create_test"] == 0.0


def test_humaneval_right_program_scores_one_and_wrong_zero(chat_run):
    """Canonical solutions pass and wrong bodies fail, executed in the sandbox through the task's filter."""
    tokenizer = chat_run.data.tokenizer_
    key = ("ompmoe_humaneval_instruct", "pass@1,create_test")

    def program(which: str):
        def answer(request, until: list[str]) -> list[int]:
            doc = request.instance.doc
            if "task_id" not in doc:  # gsm8k of the same run
                return tokenizer.encode("#### 0", add_special_tokens=False)
            right = which == "right" or (which == "first" and doc["task_id"] == "HumanEval/0")
            body = doc["canonical_solution"] if right else "    return None\n"
            return tokenizer.encode(body + "```\nDone.", add_special_tokens=False)
        return answer

    assert _stub_tokens(chat_run, program("right"))[key] == 1.0
    assert _stub_tokens(chat_run, program("wrong"))[key] == 0.0
    assert _stub_tokens(chat_run, program("first"))[key] == 1 / CHAT_LIMIT


def test_chat_prompts_equal_hflms_without_fewshot_as_multiturn(data_root, chat_tokenizer):
    """Prompt building alone (no generation): with ``fewshot_as_multiturn=False`` the bridge's GSM8K chat requests
    equal the ones ``simple_evaluate`` hands to ``HFLM`` (the few-shot examples inside one user message). The
    multi-turn form is compared, generations included, by ``test_chat_template_runs_equal_hflms``."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    class PromptsOnly(HFLM):
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            return [""] * len(requests)

    lm = PromptsOnly(pretrained=resolve_shipped(MODEL), tokenizer=str(chat_tokenizer), device="cpu",
                     max_length=CHAT_MAX_LENGTH, dtype=DTYPE)
    manager = TaskManager()
    settings = dict(num_fewshot=5, apply_chat_template=True, fewshot_as_multiturn=False,
                    system_instruction=SYSTEM, limit=CHAT_LIMIT)
    data = LMEvalDataModule(tasks=["gsm8k"], data_dir=str(data_root), max_length=CHAT_MAX_LENGTH, **settings)
    data.build(AutoTokenizer.from_pretrained(chat_tokenizer))
    ours = [[request.instance.args[0], request.instance.args[1]]
            for request in sorted(data.plan.requests, key=lambda request: request.instance.doc_id)]
    with _hub_from(data_root):
        out = simple_evaluate(model=lm, tasks=["gsm8k"], bootstrap_iters=0, log_samples=True, task_manager=manager,
                              **settings)
    samples = sorted((sample for sample in out["samples"]["gsm8k"] if sample["filter"] == "strict-match"),
                     key=lambda sample: sample["doc_id"])  # one sample per doc and filter
    theirs = [[sample["arguments"][0][0], sample["arguments"][0][1]] for sample in samples]  # one request per doc
    assert len(ours) == CHAT_LIMIT and ours == theirs
    for context, _ in ours:
        assert context.startswith(f"<|system|>\n{SYSTEM}\n<|user|>\n") and context.count("Question:") == 6
        assert context.count("<|user|>\n") == 1 and context.count("<|assistant|>\n") == 1  # shots in one message
