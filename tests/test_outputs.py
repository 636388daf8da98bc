"""Outputs never swallow the run's inputs, odd output paths fail up front, and re-planning keeps the fit's settings.

Issue 26 (items 1 and 9) and issue 21 (item 6): every entry point (``ompmoe fit`` / ``ExpertPruning``,
``ompmoe prune``, ``ompmoe plot``, ``ompmoe-demo``, the fine-tuning CLI) passes what it reads to the output check.
"""

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import yaml

import ompmoe
from ompmoe.cli import main
from ompmoe.data import byte_tokens, shipped_text
from ompmoe.engine.io import MARKER, OutputNotReplaceableError, OutputNotWritableError, atomic_path, check_writable
from ompmoe.engine.summary import kept_summary
from ompmoe.engine.tiny import tiny_model
from test_cli import tiny_config as cli_tiny_config


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def tiny_config(tmp_path: Path, output_dir: str, **changes) -> Path:
    """configs/tiny.yaml (``overwrite: true``, auto: omp_normalized + loss on qwen3_moe) on 4 x 64 tokens, writing to ``output_dir``."""
    path = cli_tiny_config(tmp_path, **changes)
    config = yaml.safe_load(path.read_text())
    config["trainer"]["callbacks"][0]["init_args"]["output_dir"] = output_dir
    config["trainer"]["enable_progress_bar"] = False
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def earlier_run(tmp_path, monkeypatch):
    """``out/`` as the README's re-pruning flow leaves it: an ompmoe output with ``model-0.25`` and ``calib.txt``."""
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(), atomic_path("out", directory=True) as tmp:
        warnings.simplefilter("ignore")  # no tokenizer for the random tiny model: bytes
        ompmoe.save_pruned(tiny_model("qwen3_moe"), tmp / "model-0.25")
        (tmp / "calib.txt").write_text(shipped_text()[:20000])
    return Path("out")


def contains(output: str, item: str) -> str:
    return f"{output} contains the input {item}; replacing it would delete the input. Choose another output path."


@pytest.mark.parametrize("model, source, named", [
    ("out/model-0.25", "out/calib.txt", "out/model-0.25"),
    ("tiny:qwen3_moe", "out/calib.txt", "out/calib.txt"),
])
def test_fit_refuses_an_output_dir_holding_its_model_or_data(earlier_run, tmp_path, model, source, named):
    before = names(earlier_run)
    config = tiny_config(tmp_path, "out", **{"model.model": model, "data.source": source, "data.tokenizer": "bytes"})
    with pytest.raises(SystemExit) as error:
        main(["fit", "-c", str(config), "--overwrite"])  # even when asked to replace it
    assert str(error.value) == f"error: {contains('out', named)}"
    assert names(earlier_run) == before and ompmoe.load_pruned("out/model-0.25") is not None


def test_prune_and_plot_refuse_an_output_dir_holding_their_inputs(earlier_run, tmp_path):
    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), [byte_tokens("calibration text " * 8)[None]])
    stats_file = str(stats.save(tmp_path / "stats.safetensors"))
    plan_file = str(ompmoe.plan_pruning(stats, 0.5).save(Path("out") / "plan-elsewhere.json", overwrite=False))
    before = names(earlier_run)
    for command, named in (
        (["prune", "--stats", stats_file, "--ratio", "0.5", "--model", "tiny:qwen3_moe", "--tokenizer",
          "out/calib.txt"], "out/calib.txt"),
        (["prune", "--stats", stats_file, "--ratio", "0.5", "--model", "out/model-0.25"], "out/model-0.25"),
        (["plot", "--stats", stats_file, "--plan", plan_file], plan_file),
    ):
        with pytest.raises(SystemExit) as error:
            main([*command, "--output_dir", "out", "--overwrite"])
        assert str(error.value) == f"error: {contains('out', named)}"
    assert names(earlier_run) == before


def test_demo_refuses_an_output_dir_holding_the_shipped_data(tmp_path, monkeypatch):
    from ompmoe.recipes.quickstart import DATA_DIR, prune_tiny_model

    package = DATA_DIR.parent
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputNotReplaceableError) as error:
        prune_tiny_model(output_dir=str(package), overwrite=True)
    assert str(error.value) == contains(str(package), str(DATA_DIR))


def finetune(tmp_path: Path, model: str, save_dir: str, *options: str) -> None:
    from ompmoe.lightning.finetune_module import main

    main([
        "fit", "--model.model", model, "--model.save_dir", save_dir, *options,
        "--data.source", "shipped", "--data.tokenizer", "bytes", "--data.seq_len", "16", "--data.num_blocks", "2",
        "--data.val_sources", "[]", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
        "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "lightning"),
    ])


def test_finetune_refuses_a_save_dir_holding_its_model_before_training(earlier_run, tmp_path, monkeypatch):
    from ompmoe.lightning.finetune_module import FinetuneModule

    steps = []
    monkeypatch.setattr(FinetuneModule, "training_step", lambda self, *args: steps.append(args))
    before = names(earlier_run)
    with pytest.raises(SystemExit) as error:  # the fine-tuning CLI: one error line, status 2
        finetune(tmp_path, "out/model-0.25", "out", "--model.overwrite", "true")
    assert error.value.code == 2 and str(error.value) == "error: " + contains("out", "out/model-0.25")
    with pytest.raises(SystemExit, match=r"^error: out already exists; pass --overwrite \(overwrite=True in Python\)"):
        finetune(tmp_path, "tiny:qwen3_moe", "out")
    assert names(earlier_run) == before and steps == []


# --------------------------------------------------------------------------- output paths (issue 26, item 9)
def test_a_name_too_long_for_the_temporary_fails_up_front(tmp_path):
    extra = len(f"..{ompmoe.engine.io._owner()}.01234567.scratch")  # the longest sibling: a run's scratch
    fits, too_long = tmp_path / ("n" * (255 - extra)), tmp_path / ("n" * (256 - extra))
    check_writable(fits, overwrite=False, directory=True)
    with pytest.raises(OutputNotWritableError) as error:
        check_writable(too_long, overwrite=False, directory=True)
    assert str(error.value) == (
        f"[Errno 36] cannot write {too_long}: its name is {256 - extra} bytes long, and its temporary sibling "
        f"(.<name>.{ompmoe.engine.io._owner()}.<random>.scratch) needs {extra} more than that, over the 255 bytes this "
        f"file system allows; choose an output name of at most {255 - extra} bytes"
    )
    with pytest.raises(SystemExit, match=r"^error: \[Errno 36\] cannot write .*choose an output name of at most"):
        main(["prune", "--stats", str(tmp_path / "not-read.safetensors"), "--ratio", "0.5",
              "--output_dir", str(too_long)])
    with pytest.raises(OutputNotWritableError, match=r"the directory name 'ddd.*' is longer than the 255 bytes"):
        check_writable(tmp_path / ("d" * 256) / "out", overwrite=False)
    with atomic_path(fits, directory=True) as tmp:  # the longest name that fits is written
        (tmp / "x").write_text("x")
    assert names(tmp_path) == [fits.name]


def test_dot_dot_in_an_output_path_is_resolved_and_leaves_no_directory(tmp_path):
    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), [byte_tokens("calibration text " * 8)[None]])
    stats_file = str(stats.save(tmp_path / "stats.safetensors"))
    main(["prune", "--stats", stats_file, "--ratio", "0.5", "--output_dir", str(tmp_path / "X" / "newsub" / ".."),
          "--quiet"])
    assert names(tmp_path) == ["X", "stats.safetensors"] and names(tmp_path / "X") == [MARKER, "plan-0.5.json"]
    with pytest.raises(SystemExit) as error:  # X exists now: refused up front as X, no "appeared while writing"
        main(["prune", "--stats", stats_file, "--ratio", "0.5", "--output_dir", str(tmp_path / "X" / "new" / "..")])
    assert str(error.value) == (f"error: {tmp_path / 'X'} already exists; pass --overwrite (overwrite=True in Python) "
                                "to replace it, or choose another output path.")
    assert names(tmp_path / "X") == [MARKER, "plan-0.5.json"]


def test_a_failed_write_removes_the_directories_it_made(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(tmp_path / "a" / "b" / "out", directory=True) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    assert names(tmp_path) == []


# ---------------------------------------------------------------- re-planning keeps the fit's settings (issue 21.6)
def test_prune_without_method_uses_the_fits_plan_and_says_so(tmp_path, capsys, monkeypatch):
    import ompmoe.callbacks.pruning

    run, logged = tmp_path / "run", []
    monkeypatch.setattr(ompmoe.callbacks.pruning, "rank_zero_info", logged.append)  # Lightning's console logger
    config = tiny_config(tmp_path, str(run))
    fit = yaml.safe_load(config.read_text())
    fit["trainer"]["callbacks"][0]["init_args"]["loss_aware"] = True
    fit["trainer"]["callbacks"][0]["init_args"]["strategy"]["init_args"].update(method="omp_normalized", allocation="loss")
    config.write_text(yaml.safe_dump(fit))
    main(["fit", "-c", str(config)])
    fit_plan = ompmoe.PruningPlan.load(run / "plan.json")
    assert (fit_plan.method, fit_plan.allocation) == ("omp_normalized", "loss")  # not the default omp + waterfill
    assert logged[0] == ("ompmoe: method omp_normalized, allocation loss (as given; omp_normalized's own is "
                         "waterfill), compensation off (none for a named method), risk_weight 3, min_kept_fraction "
                         "0.375, max_kept_fraction 0.875, zeta 1e-06")
    capsys.readouterr()
    main(["prune", "--stats", str(run / "stats.safetensors"), "--ratio", "0.5", "--output_dir", str(tmp_path / "a")])
    replanned = ompmoe.PruningPlan.load(tmp_path / "a" / "plan-0.5.json")
    assert replanned.kept_by_layer() == fit_plan.kept_by_layer()
    assert replanned == dataclasses.replace(fit_plan, extra={})  # plans alone: nothing measured on held-out text
    assert capsys.readouterr().out.splitlines() == [
        "ompmoe prune: method omp_normalized (the fit's plan), allocation loss (the fit's plan), compensation off "
        "(the fit's plan), risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06 (risk_weight, "
        f"min_kept_fraction, max_kept_fraction, zeta from the fit's plan {run / 'plan.json'})",
        f"ratio 0.5: {kept_summary(fit_plan)} -> {tmp_path / 'a' / 'plan-0.5.json'}",
    ]
    # A method named runs as published: its own allocation (not the fit's loss), no compensation; what does not
    # depend on the method still comes from the fit, and an option given wins.
    main(["prune", "--stats", str(run / "stats.safetensors"), "--ratio", "0.5", "--output_dir", str(tmp_path / "b"),
          "--method", "omp", "--risk_weight", "2"])
    explicit = ompmoe.PruningPlan.load(tmp_path / "b" / "plan-0.5.json")
    stats = ompmoe.MoEStats.load(run / "stats.safetensors")
    assert explicit == ompmoe.plan_pruning(stats, 0.5, method="omp", allocation="waterfill", risk_weight=2.0)
    assert capsys.readouterr().out.splitlines()[0] == (
        "ompmoe prune: method omp (option), allocation waterfill (omp's own), compensation off (none for a named "
        "method), risk_weight 2, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06 (min_kept_fraction, "
        f"max_kept_fraction, zeta from the fit's plan {run / 'plan.json'})")
    main(["prune", "--stats", str(run / "stats.safetensors"), "--ratio", "0.5", "--output_dir", str(tmp_path / "c"),
          "--method", "reap", "--allocation", "loss"])
    assert ompmoe.PruningPlan.load(tmp_path / "c" / "plan-0.5.json") == ompmoe.plan_pruning(
        stats, 0.5, method="reap", allocation="loss")
    assert capsys.readouterr().out.splitlines()[0].startswith(
        "ompmoe prune: method reap (option), allocation loss (option; reap's own is uniform), compensation off (none "
        "for a named method), ")


def test_prune_beside_no_plan_of_these_statistics_uses_the_defaults(tmp_path, capsys):
    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), [byte_tokens("calibration text " * 8)[None]])
    stats_file = stats.save(tmp_path / "stats.safetensors")
    other = ompmoe.collect_stats(tiny_model("qwen3_moe"), [byte_tokens("other text " * 9)[None]])
    ompmoe.plan_pruning(other, 0.5, method="random", allocation="uniform",
                        method_options={"seed": 3}).save(tmp_path / "plan.json")
    main(["prune", "--stats", str(stats_file), "--ratio", "0.5", "--output_dir", str(tmp_path / "p")])
    plan = ompmoe.PruningPlan.load(tmp_path / "p" / "plan-0.5.json")
    assert plan == ompmoe.plan_pruning(stats, 0.5)
    assert capsys.readouterr().out.splitlines()[0] == (
        "ompmoe prune: method omp (default), allocation waterfill (default), compensation off (default), "
        "risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06")
    # The fit's method options come with its method.
    ompmoe.plan_pruning(stats, 0.5, method="random", allocation="uniform",
                        method_options={"seed": 3}).save(tmp_path / "plan.json", overwrite=True)
    main(["prune", "--stats", str(stats_file), "--ratio", "0.5", "--output_dir", str(tmp_path / "q")])
    assert ompmoe.PruningPlan.load(tmp_path / "q" / "plan-0.5.json") == ompmoe.PruningPlan.load(tmp_path / "plan.json")
    assert capsys.readouterr().out.splitlines()[0] == (
        "ompmoe prune: method random (the fit's plan), allocation uniform (the fit's plan), compensation off "
        "(the fit's plan), risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06, seed 3 (risk_weight, "
        f"min_kept_fraction, max_kept_fraction, zeta, method_options from the fit's plan {tmp_path / 'plan.json'})")


def test_a_fit_plan_from_a_newer_ompmoe_still_serves_and_a_broken_one_is_named_as_the_fits(tmp_path, capsys):
    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), [byte_tokens("calibration text " * 8)[None]])
    stats_file = stats.save(tmp_path / "stats.safetensors")
    fit_plan = ompmoe.plan_pruning(stats, 0.5, method="random", allocation="uniform", method_options={"seed": 3})
    newer = {**fit_plan.to_dict(), "notes": "a newer field"}
    newer["layers"] = [{**layer, "score": 1.0} for layer in newer["layers"]]
    (tmp_path / "plan.json").write_text(json.dumps(newer))
    with pytest.warns(UserWarning) as caught:
        main(["prune", "--stats", str(stats_file), "--ratio", "0.5", "--output_dir", str(tmp_path / "p")])
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'plan.json'} has keys this ompmoe does not know, ignored: notes, score "
        f"(written by ompmoe {fit_plan.library_version})."]
    assert ompmoe.PruningPlan.load(tmp_path / "p" / "plan-0.5.json") == fit_plan  # the fit's settings, taken
    (tmp_path / "plan.json").write_text(json.dumps({**fit_plan.to_dict(), "layers": [{"name": "x"}]}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as error:
        main(["prune", "--stats", str(stats_file), "--ratio", "0.5", "--output_dir", str(tmp_path / "q")])
    assert error.value.code == 2 and not (tmp_path / "q").exists()
    line = capsys.readouterr().err
    assert line.startswith(f"error: {tmp_path / 'plan.json'} is not a valid ompmoe plan (TypeError: ")
    assert line.endswith("(ompmoe prune reads the fit's plan beside --stats for the settings not given; give --method, "
                         "--allocation, --risk_weight, --min_kept_fraction, --max_kept_fraction, --zeta and "
                         "--method_options to do without it)\n") and line.count("\n") == 1


def test_an_input_that_is_a_symlink_inside_the_output_counts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("real.txt").write_text("text")
    with atomic_path("out", directory=True) as tmp:
        (tmp / "calib.txt").symlink_to(tmp_path / "real.txt")
    with pytest.raises(OutputNotReplaceableError) as error:
        check_writable("out", overwrite=True, directory=True, inputs=["out/calib.txt"])
    assert str(error.value) == contains("out", "out/calib.txt")
    check_writable("out", overwrite=True, directory=True, inputs=["real.txt"])  # the target alone does not block


def test_the_card_names_the_model_pruned_and_says_in_one_line_that_the_statistics_name_another(tmp_path):
    """Statistics collected as another model (a renamed copy, a mirror) never put that name on the pruned model."""
    import subprocess
    import sys

    import torch
    import transformers

    from ompmoe.engine.names import shipped_model_path

    model = transformers.AutoModelForCausalLM.from_pretrained(shipped_model_path("tiny-moe"), dtype=torch.float32)
    stats = ompmoe.collect_stats(model, [byte_tokens(shipped_text()[:64])[None] + 3],
                                 model_id="no-such-org/no-such-model")
    stats.save(tmp_path / "stats.safetensors")
    done = subprocess.run([sys.executable, "-m", "ompmoe", "prune", "--stats", "stats.safetensors", "--ratio", "0.5",
                           "--model", "shipped:tiny-moe", "--output_dir", "out", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    own = [line for line in done.stderr.splitlines() if "no-such" in line]
    assert own == ["warning: The statistics were collected as 'no-such-org/no-such-model' but the model pruned was "
                   "loaded from 'shipped:tiny-moe'; the model card and config.json name 'shipped:tiny-moe'."]
    card = (tmp_path / "out" / "model-0.5" / "README.md").read_text()
    assert "# shipped:tiny-moe, experts pruned with ompmoe" in card and "base_model:" not in card
    assert "Statistics collected as `no-such-org/no-such-model`." in card
    record = json.loads((tmp_path / "out" / "model-0.5" / "config.json").read_text())["ompmoe"]["plan"]
    assert (record["model_id"], record["statistics_model_id"]) == ("shipped:tiny-moe", "no-such-org/no-such-model")
