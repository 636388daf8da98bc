"""Evaluation never overwrites and never compares unlike runs (issue 44, item 5), through the commands a user types.

``ompmoe validate`` / ``ompmoe test`` refuse an existing results file before the model or the tasks load, replace it
with ``--overwrite`` and say where they wrote; ``ompmoe report`` refuses a baseline and a row scored on other items
(another ``--data.limit``), as it refuses another base model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from test_report import PRUNED, results, write  # noqa: E402

from ompmoe.cli import main  # noqa: E402
from ompmoe.eval import EvalModule, LMEvalDataModule  # noqa: E402

HERE = Path(__file__).resolve().parents[1]  # tests/
TASKS_DIR = str(HERE / "eval_tasks")
CONFIG = str(HERE.parent / "configs" / "eval" / "tiny.yaml")


def validate(output: Path, limit: int, *extra: str, command: str = "validate") -> None:
    """``ompmoe validate -c configs/eval/tiny.yaml`` on ``limit`` items of ``tiny_mc``, no timing probe, no logs."""
    main([command, "-c", CONFIG, "--data.include_path", TASKS_DIR, "--data.tasks", "[tiny_mc]",
          "--data.limit", str(limit), "--data.output_path", str(output), "--model.timing_repeats", "0",
          "--trainer.logger", "false", "--trainer.default_root_dir", str(output.parent), *extra])


@pytest.fixture(scope="module")
def two_items(tmp_path_factory) -> Path:
    """A results file of ``ompmoe validate --data.limit 2``."""
    output = tmp_path_factory.mktemp("eval") / "two.json"
    validate(output, 2)
    return output


def _no_work(monkeypatch) -> None:
    """Fail the test if the tasks or the model start loading."""
    def refuse(*args, **kwargs):
        raise AssertionError("expensive work started before the results file was checked")

    monkeypatch.setattr(LMEvalDataModule, "build", refuse)
    monkeypatch.setattr(EvalModule, "configure_model", refuse)


@pytest.mark.parametrize("command", ["validate", "test"])
def test_existing_results_file_is_refused_before_any_work(two_items, tmp_path, monkeypatch, capsys, command):
    output = tmp_path / "results.json"
    shutil.copy(two_items, output)
    before = output.read_text()
    _no_work(monkeypatch)
    capsys.readouterr()
    for extra in ([], ["--overwrite", "false"]):
        with pytest.raises(SystemExit) as error:
            validate(output, 2, *extra, command=command)
        assert error.value.code == 2
        expected = (f"error: {output} already exists; pass --overwrite (overwrite=True in Python) to replace it, "
                    "or choose another output path.")
        assert str(error.value) == expected
        assert capsys.readouterr().err.splitlines() == [expected]
        assert output.read_text() == before


def test_a_directory_output_path_refuses_its_existing_results_json(two_items, tmp_path, monkeypatch):
    shutil.copy(two_items, tmp_path / "results.json")
    _no_work(monkeypatch)
    with pytest.raises(SystemExit) as error:
        validate(tmp_path, 2)
    assert str(error.value).startswith(f"error: {tmp_path / 'results.json'} already exists; pass --overwrite")


def test_overwrite_replaces_the_results_file_and_says_where(two_items, tmp_path, capsys):
    output = tmp_path / "results.json"
    shutil.copy(two_items, output)
    capsys.readouterr()
    validate(output, 3, "--overwrite", command="test")  # bare: true, as on every ompmoe command
    assert capsys.readouterr().out.splitlines()[-1] == f"ompmoe test: wrote results to {output}"  # after the metrics
    written = json.loads(output.read_text())
    assert written["config"]["limit"] == 3 and written["n-samples"]["tiny_mc"]["effective"] == 3
    assert written["ompmoe"]["model"]["stage"] == "test"
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".")) == []  # no temporaries


def test_python_api_refuses_an_existing_results_file_at_setup(two_items, tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from ompmoe.engine.io import OutputExistsError

    output = tmp_path / "results.json"
    shutil.copy(two_items, output)
    _no_work(monkeypatch)
    data = LMEvalDataModule(tasks=["tiny_mc"], include_path=TASKS_DIR, limit=2, output_path=str(output))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(OutputExistsError, match="overwrite=True in Python"):
        trainer.validate(EvalModule("tiny:qwen3_moe", tokenizer="bytes"), datamodule=data, verbose=False)


def test_a_module_replaces_its_own_results_but_not_a_file_changed_since(tmp_path):
    import lightning.pytorch as pl

    from ompmoe.engine.io import OutputExistsError

    output = tmp_path / "results.json"
    data = LMEvalDataModule(tasks=["tiny_mc"], include_path=TASKS_DIR, limit=2, bootstrap_iters=0,
                            output_path=str(output))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = EvalModule("tiny:qwen3_moe", tokenizer="bytes", timing_repeats=0)
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.test(module, datamodule=data, verbose=False)  # its own file: replaced by the next stage
    assert json.loads(output.read_text())["ompmoe"]["model"]["stage"] == "test" and data.written == output
    output.write_text("{}")  # another run's (or the user's) file now
    with pytest.raises(OutputExistsError, match="already exists; pass --overwrite"):
        trainer.validate(module, datamodule=data, verbose=False)
    assert output.read_text() == "{}"


# ------------------------------------------------------------------------------- ompmoe report
def test_report_refuses_a_baseline_scored_on_other_items(two_items, tmp_path, capsys):
    """The issue's case: a 2-item baseline against a run on more items (here 4) printed a retained percentage."""
    four = tmp_path / "four.json"
    validate(four, 4)
    capsys.readouterr()
    with pytest.raises(SystemExit) as error:
        main(["report", str(two_items), str(four)])
    assert error.value.code == 2
    expected = (
        f"error: These results cannot be compared with the baseline {two_items}: {four} scored on other items "
        "(--data.limit 4 vs 2; tiny_mc: 4 vs 2 items), so a retained percentage or speedup would compare different "
        "questions. Rerun one of them with the same --data.limit as the other (and the same data sets); or pass "
        "allow_mismatch=True (CLI: --allow-mismatch) to print them marked, without a retained percentage or speedup.")
    assert str(error.value) == expected
    assert capsys.readouterr() == ("", expected + "\n")


def _limited(label: str, score: float, items: int, limit: float | None, **kwargs) -> dict:
    data = results(label, {"word_order": score}, items=items, **kwargs)
    data["config"]["limit"] = limit
    return data


def test_report_refuses_other_item_counts_and_marks_them_when_allowed(tmp_path, capsys):
    base = write(tmp_path / "base.json", _limited("original", 0.835, 2, 2))
    pruned = write(tmp_path / "pruned.json", _limited("pruned", 0.805, 200, None, pruning=PRUNED))
    with pytest.raises(SystemExit) as error:
        main(["report", base, pruned])
    assert str(error.value) == (
        f"error: These results cannot be compared with the baseline {base}: {pruned} scored on other items "
        "(--data.limit none vs 2; word_order: 200 vs 2 items), so a retained percentage or speedup would compare "
        "different questions. Rerun one of them with the same --data.limit as the other (and the same data sets); "
        "or pass allow_mismatch=True (CLI: --allow-mismatch) to print them marked, without a retained percentage "
        "or speedup.")
    capsys.readouterr()
    main(["report", base, pruned, "--allow-mismatch"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == ["| original | 83.50 | 83.50 | 100.0 |", "| pruned ⚠ | 80.50 | 80.50 | – |"]
    assert lines[-1].endswith(
        ". ⚠ pruned is not comparable with original: scored on other items (--data.limit none vs 2; word_order: "
        "200 vs 2 items).")


def test_report_names_at_most_three_tasks_and_compares_equal_counts_under_other_limits(tmp_path, capsys):
    scores = {f"t{i}": 0.5 for i in range(5)}
    base = write(tmp_path / "base.json", results("original", scores, items=10))
    other = write(tmp_path / "other.json", results("pruned", scores, items=20, pruning=PRUNED))
    with pytest.raises(SystemExit) as error:
        main(["report", base, other])
    assert ("scored on other items (t0: 20 vs 10 items; t1: 20 vs 10 items; t2: 20 vs 10 items; and 2 more tasks)"
            in str(error.value))
    # Files without item counts: their recorded limits decide.
    uncounted = [_limited(label, 0.5, 1, limit) for label, limit in (("original", 2), ("pruned", 4))]
    for data in uncounted:
        del data["n-samples"]
    files = [write(tmp_path / f"{data['ompmoe']['label']}.json", data) for data in uncounted]
    with pytest.raises(SystemExit) as error:
        main(["report", *files])
    assert f"{files[1]} scored on other items (--data.limit 4 vs 2), so" in str(error.value)
    # A limit above every task's size picks the same items as none: those rows compare.
    same = write(tmp_path / "same.json", _limited("pruned", 0.8, 200, 500, pruning=PRUNED))
    full = write(tmp_path / "full.json", _limited("original", 0.8, 200, None))
    capsys.readouterr()
    main(["report", full, same])
    assert capsys.readouterr().out.splitlines()[3] == "| pruned | 80.00 | 80.00 | 100.0 |"


# ------------------------------------------------------------------------------- pip install -e ".[eval]"
def test_eval_extra_gives_what_the_stock_lm_eval_hf_model_imports():
    """``lm_eval --model hf`` imports lm-eval's ``hf`` extra at load time (accelerate among them); ``.[eval]`` must
    install it. peft is left out: lm-eval imports it only for ``--model_args peft=...``."""
    tomllib = pytest.importorskip("tomllib")
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    def name(text: str) -> str:
        return Requirement(text).name.lower().replace("_", "-")

    project = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    declared = {name(text) for text in [*project["dependencies"], *extras["eval"], *extras["lightning"]]}
    hf = {name(text) for text in requires("lm_eval") or []
          if Requirement(text).marker is not None and Requirement(text).marker.evaluate({"extra": "hf"})}
    assert "accelerate" in hf
    assert hf - declared == {"peft"}
