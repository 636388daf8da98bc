"""One input given where another is expected: the error says what the file is and what to pass, in one line,
before any model work (not a parser's "truncated" or a tokenizer library's complaint)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ompmoe
from ompmoe.cli import main
from ompmoe.engine.collect.input_kinds import input_kind
from ompmoe.engine.collect.synthetic import synthetic_stats
from ompmoe.engine.tiny import tiny_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run's output folder as ``ompmoe fit`` writes it: statistics, plan and the pruned model."""
    run = tmp_path_factory.mktemp("kinds") / "run"
    run.mkdir()
    model = tiny_model("qwen3_moe", seed=0)
    import torch

    stats = ompmoe.collect_stats(model, [torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))],
                                 model_id="tiny:qwen3_moe")
    stats.save(run / "stats.safetensors")
    plan = ompmoe.PruningStrategy(ratio=0.5).plan(stats)
    plan.save(run / "plan.json")
    ompmoe.save_pruned(ompmoe.prune(model, plan), run / "model", tokenizer=None)
    (run / "results.json").write_text(json.dumps({"results": {"arc_easy": {"acc,none": 0.5}}, "versions": {}}))
    return run


def test_each_kind_is_recognised(run_dir, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    synthetic = synthetic_stats(2, 8, 2).save(tmp_path / "synthetic.safetensors")
    assert {name: input_kind(run_dir / name) for name in
            ["stats.safetensors", "plan.json", "model", "results.json", "model/model.safetensors"]} == {
        "stats.safetensors": "statistics", "plan.json": "plan", "model": "model", "results.json": "results",
        "model/model.safetensors": "weights"}
    assert input_kind(run_dir) == "run"
    assert input_kind(synthetic) == "statistics"
    assert [input_kind(path) for path in (tmp_path / "notes.txt", tmp_path / "missing", tmp_path)] == [None] * 3


def cli_lines(args, capsys) -> list[str]:
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_prune_and_plot_name_a_swapped_input(run_dir, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli_lines(["prune", "--stats", str(run_dir / "plan.json"), "--ratio", "0.5", "--output_dir", out],
                     capsys) == [f"error: {run_dir / 'plan.json'} is a pruning plan (plan.json), not ompmoe statistics "
                                 f"(stats.safetensors); pass {run_dir / 'stats.safetensors'} instead"]
    assert cli_lines(["prune", "--stats", str(run_dir), "--ratio", "0.5", "--output_dir", out], capsys) == [
        f"error: {run_dir} is the output folder of an ompmoe run, not ompmoe statistics (stats.safetensors); "
        f"pass {run_dir / 'stats.safetensors'} instead"]
    assert cli_lines(["plot", "--stats", str(run_dir / "stats.safetensors"), "--plan", str(run_dir / "stats.safetensors"),
                      "--output_dir", out], capsys) == [
        f"error: {run_dir / 'stats.safetensors'} is ompmoe statistics (stats.safetensors), not a pruning plan "
        f"(plan.json); pass {run_dir / 'plan.json'} instead"]
    assert cli_lines(["prune", "--stats", str(run_dir / "results.json"), "--ratio", "0.5", "--output_dir", out],
                     capsys) == [f"error: {run_dir / 'results.json'} is an lm-eval results file, not ompmoe statistics "
                                 "(stats.safetensors); pass ompmoe statistics (stats.safetensors)"]
    assert not Path(out).exists()


def test_fit_names_a_run_folder_or_a_plan_given_as_the_model(run_dir):
    """In a fresh process, as a user types it: one line, status 2, before the Trainer starts."""
    for given in (run_dir, run_dir / "plan.json"):
        done = subprocess.run([sys.executable, "-m", "ompmoe.cli", "fit", "-c", "configs/tiny.yaml", "--model.model",
                               str(given), "--trainer.callbacks.output_dir", str(run_dir.parent / "never")],
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
        assert done.returncode == 2, done.stderr
        what = "the output folder of an ompmoe run" if given == run_dir else "a pruning plan (plan.json)"
        assert done.stderr.strip().splitlines() == [
            f"error: {given} is {what}, not a model folder (config.json); pass {run_dir / 'model'} instead"]
        assert not (run_dir.parent / "never").exists()


def test_the_python_loaders_name_a_swapped_input(run_dir):
    with pytest.raises(ValueError) as error:
        ompmoe.MoEStats.load(run_dir / "plan.json")
    assert str(error.value) == (f"{run_dir / 'plan.json'} is a pruning plan (plan.json), not ompmoe statistics "
                                f"(stats.safetensors); pass {run_dir / 'stats.safetensors'} instead")
    with pytest.raises(ValueError) as error:
        ompmoe.PruningPlan.load(run_dir / "stats.safetensors")
    assert str(error.value) == (f"{run_dir / 'stats.safetensors'} is ompmoe statistics (stats.safetensors), not a "
                                f"pruning plan (plan.json); pass {run_dir / 'plan.json'} instead")
    with pytest.raises(ValueError) as error:
        ompmoe.MoEStats.load(run_dir / "model" / "model.safetensors")
    assert str(error.value).startswith(f"{run_dir / 'model' / 'model.safetensors'} is a safetensors file of weights, "
                                       "not ompmoe statistics")
    assert ompmoe.PruningPlan.load(run_dir / "plan.json").layers  # the right kinds still load
    assert ompmoe.MoEStats.load(run_dir / "stats.safetensors").num_tokens == 32
