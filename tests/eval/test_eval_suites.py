"""The paper's suites end to end on local fixtures: lm-eval's real task definitions through the bridge.

The hub data sets cannot be reached here, so ``tests/make_eval_fixtures.py`` writes small copies in
each data set's own schema (hub-snapshot layout) and the suites read them through
``LMEvalDataModule(data_dir=...)``, with lm-eval's task YAMLs unchanged: prompt templates,
``process_docs``, filters, regexes, group aggregation and LongBench's metric packages all run.
Every suite metric must equal ``lm_eval.simple_evaluate`` with ``HFLM`` on the same fixtures and
model (``shipped:tiny-moe``); hand-written right and wrong responses must score 1 and 0 through the
real filters and metrics.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import lightning.pytorch as pl  # noqa: E402

from ompmoe.data import resolve_shipped  # noqa: E402
from ompmoe.eval import SUITES, EvalModule, LMEvalDataModule  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import make_eval_fixtures as fixtures  # noqa: E402

MODEL = "shipped:tiny-moe"
SUITE_NAMES = ("zeroshot8", "gsm8k", "bbh", "longbench")
GENERATIVE = ("gsm8k", "bbh", "longbench")
LIMIT = 1  # documents per task (MMLU: per subject, 57; BBH: per subtask, 27; LongBench: per data set, 21)
MAX_LENGTH = 1024  # the tiny model's 512 positions leave no context for LongBench's 512-token summaries
BATCH_SIZE = 8
DTYPE = "float32"  # the shipped weights are bf16; in float32 the bridge equals HFLM exactly (docs of LMEvalDataModule)

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
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


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


@pytest.fixture(scope="module")
def bridge(data_root) -> tuple[dict, LMEvalDataModule]:
    """All four suites in one bridge evaluation (``ompmoe validate``'s path), each with its own settings."""
    data = LMEvalDataModule(suites=list(SUITE_NAMES), data_dir=str(data_root), limit=LIMIT, max_length=MAX_LENGTH,
                            batch_size=BATCH_SIZE, bootstrap_iters=0)
    module = EvalModule(MODEL, dtype=DTYPE)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.validate(module, datamodule=data, verbose=False)
    return module.eval_results, data


@pytest.fixture(scope="module")
def reference(data_root) -> dict[str, dict]:
    """``lm_eval.simple_evaluate`` with ``HFLM`` per suite, on the same fixtures, model and settings."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    path = resolve_shipped(MODEL)
    lm = HFLM(pretrained=path, tokenizer=path, batch_size=BATCH_SIZE, device="cpu", max_length=MAX_LENGTH,
              dtype=DTYPE)
    manager = TaskManager()
    out = {}
    with _hub_from(data_root):
        for name in SUITE_NAMES:
            suite = SUITES[name]
            out[name] = simple_evaluate(model=lm, tasks=list(suite.tasks), num_fewshot=suite.num_fewshot, limit=LIMIT,
                                        bootstrap_iters=0, task_manager=manager)
    return out


def test_fixtures_keep_the_hub_schemas_and_every_task_reads_its_copy(bridge, data_root):
    import datasets

    _, data = bridge
    sources = data.data_sources
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


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_suite_metrics_equal_simple_evaluate_with_hflm(bridge, reference, name):
    results, _ = bridge
    expected, actual = _numeric(reference[name]), _numeric(results)
    assert expected, name
    for key, value in expected.items():
        assert key in actual, key
        assert actual[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for column in SUITES[name].columns:  # every reported metric of the suite is produced
        section = "groups" if column.source in results.get("groups", {}) else "results"
        assert isinstance(results[section][column.source][column.metric], float), column
    assert results["ompmoe"]["scores"].keys() >= {column.name for column in SUITES[name].columns}


def test_group_aggregation_is_lm_evals(bridge):
    """MMLU is size-weighted over its subjects; LongBench (weight_by_size: False) is the plain mean of its 21
    data sets' scores (lm-eval flattens the six categories), not the mean of the category means."""
    results, _ = bridge
    per = results["results"]
    mmlu = [per[t]["acc,none"] for t in per if t.startswith("mmlu_") and t.count("_") >= 1 and "acc,none" in per[t]
            and t not in ("mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities")]
    assert len(mmlu) == 57
    assert results["groups"]["mmlu"]["acc,none"] == pytest.approx(sum(mmlu) / 57)  # one row each: weights equal
    categories = ("longbench_code", "longbench_fewshot", "longbench_multi", "longbench_single",
                  "longbench_summarization", "longbench_synthetic")
    leaves = [per[t]["score,none"] for t in per if t.startswith("longbench_") and t not in categories]
    assert len(leaves) == 21
    assert results["groups"]["longbench"]["score,none"] == pytest.approx(sum(leaves) / 21)


def _stub(data: LMEvalDataModule, right: bool) -> dict:
    """Score a fixed response per generation request (a stub model) through the tasks' real filters and metrics."""
    responses = [fixtures.ANSWERS[request.instance.task_name][0 if right else 1]
                 if request.instance.request_type == "generate_until" else (0.0, True)
                 for request in data.plan.requests]
    return _numeric(data.evaluate_responses(responses))


@pytest.fixture(scope="module")
def stubbed(bridge) -> tuple[dict, dict]:
    _, data = bridge
    return _stub(data, True), _stub(data, False)


@pytest.mark.parametrize("name", GENERATIVE)
def test_right_answers_score_one_and_wrong_answers_zero(bridge, stubbed, name):
    _, data = bridge
    gen_kwargs = {request.instance.task_name: request.instance.args[1] for request in data.plan.requests
                  if data.groups[request.group].name == name}
    right, wrong = stubbed
    if name == "gsm8k":
        assert gen_kwargs["gsm8k"]["until"] == ["Question:", "</s>", "<|im_end|>"]
        context = next(r.instance.args[0] for r in data.plan.requests if r.instance.task_name == "gsm8k")
        assert context.count("Question:") == 6 and context.count("#### ") == 5  # 5 shots from the train split
        keys = [("gsm8k", "exact_match,strict-match"), ("gsm8k", "exact_match,flexible-extract")]
    elif name == "bbh":
        assert all(kwargs["until"] == ["</s>", "Q:", "<|im_end|>"] for kwargs in gen_kwargs.values())
        keys = [(task, f"exact_match,{f}") for task in gen_kwargs for f in ("strict-match", "flexible-extract")]
        keys.append(("bbh_zeroshot", "exact_match,flexible-extract"))
    else:
        assert gen_kwargs["longbench_gov_report"]["max_gen_toks"] == 512
        assert gen_kwargs["longbench_hotpotqa"]["max_gen_toks"] == 32 and gen_kwargs["longbench_trec"]["until"] == ["\n"]
        keys = [(task, "score,none") for task in gen_kwargs] + [("longbench", "score,none")]
    assert len(keys) == {"gsm8k": 2, "bbh": 55, "longbench": 22}[name]
    for key in keys:
        assert right[key] == pytest.approx(1.0, abs=1e-6), key
        assert wrong[key] == 0.0, key


def test_fixture_script_writes_a_snapshot_tree(tmp_path):
    root = fixtures.write_all(tmp_path)
    readme = (root / "cais" / "mmlu" / "README.md").read_text()
    assert readme.count("- config_name: ") == 57 and "  - split: dev\n    path: virology/dev.jsonl" in readme
    assert sorted(p.name for p in (root / "SaylorTwift" / "bbh").iterdir() if p.is_dir()) == sorted(fixtures.BBH_SUBTASKS)
    assert fixtures.write_all(tmp_path / "again").joinpath("openai/gsm8k/main/test.jsonl").read_text() == (
        root / "openai/gsm8k/main/test.jsonl").read_text()
