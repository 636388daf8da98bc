"""What a newcomer meets on the command line: help, argument spellings, progress and quiet runs, messages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import ompmoe
from ompmoe.cli import main
from ompmoe.cli_args import bare_flags, class_paths, list_option
from ompmoe.cli_help import COMMANDS, FIT_OPTIONS
from ompmoe.engine.summary import kept_summary, settings_summary
from ompmoe.engine.collect.synthetic import synthetic_stats

ROOT = Path(__file__).parents[1]


# ------------------------------------------------------------------------------ argument spellings
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--ratio", "0.3"], ["--ratio", "[0.3]"]),
        (["--ratio", "0.25,0.5"], ["--ratio", "[0.25,0.5]"]),
        (["--ratio", "0.25, 0.5"], ["--ratio", "[0.25,0.5]"]),
        (["--ratio", "0.25", "0.5", "--method", "reap"], ["--ratio", "[0.25,0.5]", "--method", "reap"]),
        (["--ratio=0.25,0.5"], ["--ratio", "[0.25,0.5]"]),
        (["--ratio", "[0.25,0.5]"], ["--ratio", "[0.25,0.5]"]),
        (["--ratio", "[]"], ["--ratio", "[]"]),
        (["--ratio"], ["--ratio"]),
        (["--stats", "s", "--ratio", "abc"], ["--stats", "s", "--ratio", "abc"]),
        (["--ratio", "0.25,nan"], ["--ratio", "[0.25,nan]"]),  # numbers to float(); _ratios refuses nan
        (["--ratio", "0.5,x"], ["--ratio", "0.5,x"]),
        (["--ratios", "0.5"], ["--ratios", "0.5"]),  # another option is left alone
    ],
)
def test_list_option_spellings(given, expected):
    assert list_option(given, "ratio") == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["--overwrite"], ["--overwrite", "true"]),
        (["--overwrite", "--quiet"], ["--overwrite", "true", "--quiet", "true"]),
        (["--overwrite", "false"], ["--overwrite", "false"]),
        (["--overwrite", "True", "--stats", "x"], ["--overwrite", "True", "--stats", "x"]),
        (["--overwrite=false"], ["--overwrite=false"]),
        (["--plots"], ["--plots"]),
    ],
)
def test_bare_boolean_flags(given, expected):
    assert bare_flags(given, ["overwrite", "quiet"]) == expected


def test_short_class_names_in_help_options():
    assert class_paths(["fit", "--trainer.callbacks.help", "ExpertPruning"]) == [
        "fit", "--trainer.callbacks.help", "ompmoe.callbacks.ExpertPruning"]
    assert class_paths(["--trainer.callbacks.help=AdaptiveInferenceMonitor"]) == [
        "--trainer.callbacks.help=ompmoe.callbacks.AdaptiveInferenceMonitor"]
    assert class_paths(["--model.model", "ExpertPruning"]) == ["--model.model", "ExpertPruning"]


# ------------------------------------------------------------------------------------------ help
@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"]])
def test_top_level_help_lists_every_command(argv, capsys):
    main(argv)
    out = capsys.readouterr().out
    listed = re.findall(r"^  (\w+) +\S", out, flags=re.MULTILINE)
    assert listed == ["fit", "prune", "plot", "validate", "test", "predict", "report"] == list(COMMANDS)
    assert "ompmoe fit -c configs/tiny.yaml" in out


@pytest.mark.parametrize("command", ["prune", "plot", "report"])
def test_each_listed_command_answers_help(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert f"ompmoe {command}" in capsys.readouterr().out


def test_short_fit_help_names_only_options_that_exist(capsys):
    main(["fit", "-h"])
    short = capsys.readouterr().out
    assert len(short.splitlines()) < 30
    with pytest.raises(SystemExit) as done:
        main(["fit", "--help"])
    assert done.value.code == 0
    full = capsys.readouterr().out
    assert len(full.splitlines()) > 500
    for option, _ in FIT_OPTIONS:
        flag = option.split()[-2] if option.startswith("-c,") else option.split()[0]
        assert flag in short
        if flag != "--quiet" and ".init_args." not in flag:  # ompmoe's switch; init_args: checked below
            assert flag.rstrip(",") in full, flag


def test_short_fit_help_shows_how_to_set_the_ratio_and_output_dir_of_the_configs_callback(capsys):
    main(["fit", "-h"])
    assert "--trainer.callbacks.init_args.strategy.init_args.ratio" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["fit", "-c", str(ROOT / "configs" / "tiny.yaml"), "--trainer.callbacks.init_args.strategy.init_args.ratio", "0.25",
              "--trainer.callbacks.init_args.output_dir", "elsewhere", "--print_config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    callback = printed["trainer"]["callbacks"][-1]["init_args"]
    assert (callback["strategy"]["init_args"]["ratio"], callback["output_dir"]) == (0.25, "elsewhere")


def test_callback_help_by_its_short_name(capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "--trainer.callbacks.help", "ExpertPruning"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--trainer.callbacks.output_dir" in out and "--trainer.callbacks.extra_ratios" in out


# ----------------------------------------------------------------------- prune: spellings, quiet
@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    return str(synthetic_stats(4, 16, 4).save(tmp_path_factory.mktemp("stats") / "stats.safetensors"))


@pytest.mark.parametrize("ratio", [["0.25,0.5"], ["0.25", "0.5"], ["[0.25,0.5]"]])
def test_prune_accepts_list_spellings_and_bare_overwrite(ratio, stats_file, tmp_path, capsys):
    out = tmp_path / "plans"
    out.mkdir()
    (out / ".ompmoe-output").write_text("{}")  # an earlier ompmoe output, replaced with a bare --overwrite
    main(["prune", "--stats", stats_file, "--ratio", *ratio, "--output_dir", str(out), "--overwrite"])
    stats = ompmoe.MoEStats.load(stats_file)
    settings, *lines = capsys.readouterr().out.splitlines()
    defaults = {name: "default" for name in ("method", "allocation", "compensation")}  # no plan.json beside
    assert settings == f"ompmoe prune: {settings_summary(ompmoe.plan_pruning(stats, 0.5), 'off', defaults)}"
    for line, value in zip(lines, (0.25, 0.5), strict=True):
        plan = ompmoe.PruningPlan.load(out / f"plan-{value:g}.json")
        assert plan == ompmoe.plan_pruning(stats, value)
        assert line == f"ratio {value:g}: {kept_summary(plan)} -> {out / f'plan-{value:g}.json'}"


def test_prune_and_plot_quiet_print_nothing(stats_file, tmp_path, capsys):
    main(["prune", "--stats", stats_file, "--ratio", "0.5", "--output_dir", str(tmp_path / "p"), "--quiet"])
    main(["plot", "--stats", stats_file, "--output_dir", str(tmp_path / "plots"), "--quiet"])
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")
    assert (tmp_path / "p" / "plan-0.5.json").is_file() and (tmp_path / "plots" / "heatmaps.png").is_file()


def test_kept_summary_reads_as_kept_counts():
    stats = synthetic_stats(3, 16, 4)
    plan = ompmoe.plan_pruning(stats, 0.5, allocation="uniform")
    assert kept_summary(plan) == (
        "kept 24/48 routed experts (removed 0.500); per layer kept: "
        "model.layers.0.mlp 8/16, model.layers.1.mlp 8/16, model.layers.2.mlp 8/16"
    )


def test_collect_stats_progress_bar_on_request(capsys):
    import torch

    from ompmoe.engine.tiny import tiny_model

    model = tiny_model("qwen3_moe")
    batches = [torch.randint(3, 256, (1, 8)) for _ in range(3)]
    quiet = ompmoe.collect_stats(model, batches)  # default: a bar only on a terminal (pytest's stderr is not)
    assert capsys.readouterr().err == ""
    shown = ompmoe.collect_stats(model, batches, progress=True)
    err = capsys.readouterr().err
    assert "ompmoe statistics:   0%|          | 0/3" in err  # one step per batch (the bar clears itself)
    assert [layer.gram.tolist() for layer in shown.layers] == [layer.gram.tolist() for layer in quiet.layers]


# ------------------------------------------------------------------- the README's main job, quietly
WARNING_LINE = re.compile(r"warn|deprecat|tip:|failed|^[WE]\d{4} ", re.IGNORECASE)


@pytest.mark.slow  # the README's main job in a fresh process: about 13 s
def test_readme_main_job_prints_no_warning(tmp_path):
    """``ompmoe fit -c configs/tiny.yaml`` as README.md runs it (its first command), after ``pip install -e ".[lightning]"``.

    That install has no torchao (an extra of the recipes); this test environment has it, and
    transformers imports it whenever it is installed, so the job runs with torchao hidden.
    """
    script = "import sys; sys.modules['torchao'] = None; from ompmoe.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", script, "fit", "-c", str(ROOT / "configs" / "tiny.yaml")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    noise = [line for line in done.stderr.splitlines() if WARNING_LINE.search(line)]
    assert noise == []
    assert "Trainable params" not in done.stdout  # no model summary on a forward-only job
    plan = ompmoe.PruningPlan.load(tmp_path / "outputs" / "tiny" / "plan.json")
    assert f"ompmoe: {kept_summary(plan)}" in done.stderr
    assert (tmp_path / "outputs" / "tiny" / "plots" / "allocation.png").is_file()


@pytest.mark.parametrize(("method", "allocation", "said"), [
    ("reap", "waterfill", "allocation waterfill (as given; reap's own is uniform)"),  # a config's allocation
    ("reap", "auto", "allocation uniform (reap's own)"),
    ("omp", "waterfill", "allocation waterfill,"),  # the method's own, given: nothing to say
    ("omp", "uniform", "allocation uniform (as given; omp's own is waterfill)"),
])
def test_a_named_method_with_another_allocation_than_its_own_says_so(method, allocation, said):
    """``ompmoe fit -c configs/qwen3-30b-a3b.yaml --method reap`` keeps the config's waterfill: the settings line every
    front door prints says that this is not REAP as published, so a comparison says what it compares."""
    from ompmoe.engine.run import PruningRun, RunOptions

    run = PruningRun(RunOptions(strategy=ompmoe.PruningStrategy(ratio=0.5, method=method, allocation=allocation)))
    run.replan(synthetic_stats(3, 16, 4))
    settings, _ = run.summary_lines()
    assert settings.startswith(f"ompmoe: method {method}, {said}"), settings


def test_ompmoe_itself_does_not_import_torchao():
    code = ("import sys, ompmoe, ompmoe.cli, ompmoe.engine.export.plots, ompmoe.recipes.quantization, ompmoe.engine.summary; "
            "print('torchao' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.slow  # an lm-eval suite in a fresh process: about 18 s
def test_offline_evaluation_suite_prints_no_lm_eval_notice(tmp_path):
    """``ompmoe validate -c configs/eval/tiny.yaml`` (README, Evaluation): no lm-eval notices or warnings."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    script = "import sys; sys.modules['torchao'] = None; from ompmoe.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", script, "validate", "-c", "configs/eval/tiny.yaml"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    noise = [line for line in done.stderr.splitlines()
             if WARNING_LINE.search(line) or "--metadata" in line or "is defined, but" in line]
    assert noise == []
    assert (tmp_path / "outputs" / "eval-tiny" / "original.json").is_file()
