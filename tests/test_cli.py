"""The `ompmoe` command: `fit -c configs/*.yaml` and re-planning from a statistics file."""

import os
from pathlib import Path

import pytest
import torch
import yaml

import ompmoe
from ompmoe.cli import main

CONFIGS = Path(__file__).parents[1] / "configs"


def tiny_config(tmp_path: Path, **changes) -> Path:
    config = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["output_dir"] = str(tmp_path / "run")
    config["trainer"]["default_root_dir"] = str(tmp_path / "lightning")
    config["data"].update(num_blocks=4, seq_len=64)
    config["trainer"]["callbacks"][0]["init_args"]["evaluate_blocks"] = 8  # 512 tokens per set: tests, not numbers
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = value
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_with_the_tiny_config_writes_a_loadable_pruned_model(tmp_path):
    main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false"])
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir()) == [".ompmoe-output", "model", "plan.json", "plots", "stats.safetensors"]
    stats = ompmoe.MoEStats.load(run / "stats.safetensors")
    assert stats.num_tokens == 4 * 64
    assert stats.sources == ["shipped:ompmoe/data/corpus/prose-calibration,shipped:ompmoe/data/corpus/code-calibration"]
    assert stats.model_id == "shipped:tiny-moe"
    plan = ompmoe.PruningPlan.load(run / "plan.json")
    assert plan.achieved_ratio == pytest.approx(0.5)
    model = ompmoe.load_pruned(run / "model")
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [l.num_kept for l in plan.layers]
    with torch.no_grad():
        assert model(torch.arange(10)[None]).logits.shape == (1, 10, 4096)
    assert (run / "model" / "tokenizer.json").is_file()  # the shipped tokenizer is saved with the pruned model


def test_prune_replans_at_other_ratios_without_calibrating(tmp_path):
    main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false"])
    stats_file = tmp_path / "run" / "stats.safetensors"
    strategy = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())["trainer"]["callbacks"][0]["init_args"]["strategy"]
    method, allocation = strategy["init_args"]["method"], strategy["init_args"]["allocation"]
    from unittest import mock

    from ompmoe.lightning import models

    with mock.patch.object(models, "load_model", wraps=models.load_model) as loads:
        main(["prune", "--stats", str(stats_file), "--ratio", "[0.25,0.5]", "--output_dir", str(tmp_path / "plans"),
              "--model", "shipped:tiny-moe", "--method", method, "--allocation", allocation])
    assert loads.call_count == 2  # once per ratio: the model loaded to check it against the statistics is the first
    stats = ompmoe.MoEStats.load(stats_file)
    fit_plan = ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")  # "auto" as the fit resolved it
    assert (method, allocation) == ("auto", "auto") and fit_plan.method != "auto" != fit_plan.allocation
    for ratio in (0.25, 0.5):
        plan = ompmoe.PruningPlan.load(tmp_path / "plans" / f"plan-{ratio:g}.json")
        compensation = plan.extra.pop("compensation")  # fitted as the fit did (tests/test_prune_compensation.py)
        assert plan.extra.pop("heldout") == fit_plan.extra["heldout"]  # measured on the fit's held-out sets
        assert plan.extra.pop("calibration_data") == fit_plan.extra["calibration_data"]  # and its calibration text
        assert plan == ompmoe.plan_pruning(stats, ratio, method=fit_plan.method, allocation=fit_plan.allocation)
        model = ompmoe.load_pruned(tmp_path / "plans" / f"model-{ratio:g}")
        assert ompmoe.pruning_info(model)["kept_experts"] == plan.kept_by_layer()
        assert ("compensation" in ompmoe.pruning_info(model)) == compensation["applied"]
    # Complete directories: the shipped tokenizer, bf16 weights as in the source (calibration ran in float32), a card.
    from safetensors import safe_open

    written = tmp_path / "plans" / "model-0.25"
    assert (written / "tokenizer.json").read_bytes() == (Path(ompmoe.__file__).parent / "data" / "tiny-moe" /
                                                        "tokenizer.json").read_bytes()
    with safe_open(str(written / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    card = (written / "README.md").read_text()
    written_plan = ompmoe.PruningPlan.load(tmp_path / "plans" / "plan-0.25.json")
    assert f"| Method | {written_plan.method} |" in card and "| Requested ratio (experts removed) | 0.25 |" in card
    assert f"| Allocation | {written_plan.allocation} |" in card
    assert "| Calibration data | shipped:mix (the shipped corpus's calibration split: prose + code) |" in card
    assert f"| Calibration tokens | {stats.num_tokens} |" in card
    # The 0.5 plan equals the one the calibration fit made.
    assert ompmoe.PruningPlan.load(tmp_path / "plans" / "plan-0.5.json") == ompmoe.PruningPlan.load(
        tmp_path / "run" / "plan.json"
    )


def test_cli_errors_name_the_fix(tmp_path, capsys):
    main(["fit", "-c", str(tiny_config(tmp_path)), "--trainer.enable_progress_bar=false"])
    stats_file = str(tmp_path / "run" / "stats.safetensors")
    with pytest.raises(SystemExit) as error:
        main(["prune", "--stats", stats_file, "--ratio", "[0.9]", "--output_dir", str(tmp_path / "p")])
    assert str(error.value).startswith("error: ratio=0.9 keeps 10 of 96 experts")
    with pytest.raises(SystemExit) as error:
        main(["prune", "--stats", stats_file, "--ratio", "[0.25]", "--output_dir", str(tmp_path / "p"),
              "--model", "tiny:mixtral"])
    assert "These statistics were collected on a different model" in str(error.value)
    assert not (tmp_path / "p").exists()
    with pytest.raises(SystemExit) as error:
        main(["fit", "-c", str(tiny_config(tmp_path, **{"model.model": "tiny:llama"})), "--overwrite"])
    assert str(error.value) == (
        "error: model tiny:llama (LlamaForCausalLM) has no MoE layers: ompmoe prunes the routed experts of "
        "Mixture-of-Experts models; pass a model whose model_type is one of deepseek_v2, deepseek_v3, glm4_moe, "
        "gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe (e.g. shipped:tiny-moe or tiny:qwen3_moe)"
    )


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b", "mixtral-8x7b"])
def test_paper_configs_parse_with_the_papers_settings(name, capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "-c", str(CONFIGS / f"{name}.yaml"), "--print_config"])
    assert done.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    callback = config["trainer"]["callbacks"][0]
    assert callback["class_path"] == "ompmoe.callbacks.ExpertPruning"
    assert callback["init_args"]["strategy"]["init_args"]["risk_weight"] == 3.0
    assert config["model"]["dtype"] == "bfloat16"
    assert (config["data"]["source"], config["data"]["seq_len"], config["data"]["num_blocks"]) == ("wikitext2", 4096, 64)
    assert config["trainer"]["strategy"]["class_path"] == "lightning.pytorch.strategies.ModelParallelStrategy"
    assert callback["init_args"]["extra_ratios"] == [0.25]


def test_the_one_gpu_config_calibrates_layer_by_layer(capsys):
    with pytest.raises(SystemExit) as done:
        main(["fit", "-c", str(CONFIGS / "qwen3-30b-a3b-one-gpu.yaml"), "--print_config"])
    assert done.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    init = config["trainer"]["callbacks"][0]["init_args"]
    assert init["layer_by_layer"] is True and init["strategy"]["init_args"]["method"] == "omp"
    assert config["trainer"]["devices"] == 1 and (config["data"]["seq_len"], config["data"]["num_blocks"]) == (4096, 64)


def test_fit_refuses_an_existing_output_unless_overwrite_is_given(tmp_path, capsys):
    """One overwrite rule: the demo config refuses to replace its output, as ``prune`` does; ``--overwrite`` replaces."""
    assert yaml.safe_load((CONFIGS / "tiny.yaml").read_text())["trainer"]["callbacks"][0]["init_args"]["overwrite"] is False
    config = tiny_config(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "plan.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "-c", str(config), "--trainer.enable_progress_bar=false"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "pass --overwrite" in err[0], err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["plan.json"]  # nothing replaced or added


def test_fit_names_a_folder_that_holds_no_model_before_any_work(tmp_path, capsys):
    """Not the tokenizer library's error about sentencepiece: the folder is named, with the model inside it if any."""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("calibration notes")
    (tmp_path / "old" / "model").mkdir(parents=True)
    (tmp_path / "old" / "model" / "config.json").write_text("{}")
    for folder, expected in [("notes", f"error: {tmp_path / 'notes'} holds no model (no config.json)"),
                             ("old", f"error: {tmp_path / 'old'} holds no model (no config.json); model/ does: "
                                     f"pass {tmp_path / 'old' / 'model'} instead")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "-c", str(tiny_config(tmp_path)), "--model.model", str(tmp_path / folder)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [expected]
        assert not (tmp_path / "run").exists()


def test_fit_and_prune_with_a_method_named_make_the_same_plan_and_say_where_each_setting_came_from(tmp_path, capsys):
    """``ompmoe fit --method reap`` and ``ompmoe prune --method reap`` on its statistics: REAP as published (uniform,
    uncompensated), the same plan, model and held-out numbers, each settings line naming its sources."""
    from ompmoe.callbacks import pruning

    logged: list[str] = []
    original_info = pruning.rank_zero_info
    pruning.rank_zero_info = logged.append
    try:
        main(["fit", "-c", str(tiny_config(tmp_path)), "--method", "reap", "--trainer.enable_progress_bar=false"])
    finally:
        pruning.rank_zero_info = original_info
    run = tmp_path / "run"
    fit_plan = ompmoe.PruningPlan.load(run / "plan.json")
    assert (fit_plan.method, fit_plan.allocation, "compensation" in fit_plan.extra) == ("reap", "uniform", False)
    settings, kept, heldout = [line for line in logged if line.startswith("ompmoe: ") and "wrote" not in line]
    assert settings == ("ompmoe: method reap, allocation uniform (reap's own), compensation off (none for a named "
                        "method), risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06")
    capsys.readouterr()
    main(["prune", "--stats", str(run / "stats.safetensors"), "--ratio", "0.5", "--method", "reap", "--model",
          "shipped:tiny-moe", "--output_dir", str(tmp_path / "replan")])
    replanned = ompmoe.PruningPlan.load(tmp_path / "replan" / "plan-0.5.json")
    assert replanned == fit_plan  # held-out record included: measured on the same text
    assert capsys.readouterr().out.splitlines() == [
        "ompmoe prune: method reap (option), allocation uniform (reap's own), compensation off (none for a named "
        "method), risk_weight 3, min_kept_fraction 0.375, max_kept_fraction 0.875, zeta 1e-06 (risk_weight, "
        f"min_kept_fraction, max_kept_fraction, zeta from the fit's plan {run / 'plan.json'})",
        heldout.replace("ompmoe: ", "ratio 0.5: ", 1),  # the fit's numbers again
        f"ratio 0.5: {kept.removeprefix('ompmoe: ')} -> {tmp_path / 'replan' / 'model-0.5'}"]
    fitted = ompmoe.load_pruned(run / "model", dtype=torch.float32)
    again = ompmoe.load_pruned(tmp_path / "replan" / "model-0.5", dtype=torch.float32)
    tokens = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, fitted(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize(("model_type", "model_class"), [
    ("minimax_m2", "MiniMaxM2ForCausalLM"),  # its routing bias on the block
    ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),  # a multimodal container, pruned in its text decoder
    ("llama4_text", "Llama4ForCausalLM"),  # routing weights on the experts' input: auto's trial and refit too
])
def test_fit_runs_on_a_type_recognized_by_its_modules(tmp_path, model_type, model_class):
    """``ompmoe fit --model.model tiny:<type>`` on a type no spec registers: the whole default job, then a reload
    of the same class with the same pruning."""
    assert model_type not in ompmoe.ARCHITECTURES
    main(["fit", "-c", str(tiny_config(tmp_path, **{"model.model": f"tiny:{model_type}"})),
          "--trainer.enable_progress_bar=false"])
    plan = ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json")
    model = ompmoe.load_pruned(tmp_path / "run" / "model")
    assert model.config.model_type == model_type and type(model).__name__ == model_class
    assert [layer.num_experts for layer in ompmoe.find_moe_layers(model)] == [l.num_kept for l in plan.layers]


@pytest.mark.filterwarnings("ignore:No tokenizer was found")
def test_a_checkpoint_without_tokenizer_files_calibrated_on_bytes_is_written_and_a_named_one_refused_first(
        tmp_path, capsys):
    """The model's folder is where the saved tokenizer would come from: without tokenizer files it is passed over
    (the model is written, with the warning a tiny model gets), not refused once all the work is done; a tokenizer
    named outright that does not load is refused before any work."""
    import warnings

    from ompmoe.engine.tiny import tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny_model("qwen3_moe").save_pretrained(tmp_path / "checkpoint")
    capsys.readouterr()  # transformers' bar for that save
    options = ["fit", "-c", str(tiny_config(tmp_path)), "--model.model", str(tmp_path / "checkpoint"),
               "--data.tokenizer", "bytes", "--trainer.enable_progress_bar=false"]
    with pytest.raises(SystemExit) as exit_info:
        main([*options, "--trainer.callbacks.init_args.tokenizer", str(tmp_path / "checkpoint")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[0].startswith(f"error: tokenizer={str(tmp_path / 'checkpoint')!r} could not be loaded (")
    assert len(error) == 1  # the first line: refused before calibration and planning ("ompmoe: kept ..." lines)
    assert not (tmp_path / "run").exists()
    main(options)
    assert ompmoe.load_pruned(tmp_path / "run" / "model").config.model_type == "qwen3_moe"
    assert not (tmp_path / "run" / "model" / "tokenizer.json").exists()


def test_fit_on_two_devices_starts_the_second_process_with_the_same_command(tmp_path):
    """Lightning starts a multi-device run's other processes by running sys.argv again: ``ompmoe fit`` emptied it
    while the run went on, so the second process printed the usage and left, and the first waited for ever (the
    paper's config, 8 devices, too). Both processes calibrate now: every token counted once, the run written."""
    import subprocess
    import sys

    command = [str(Path(sys.executable).parent / "ompmoe"), "fit", "-c", str(tiny_config(tmp_path)), "--quiet",
               "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: ompmoe" not in done.stdout + done.stderr
    assert (tmp_path / "run" / "model" / "config.json").is_file()
    stats = ompmoe.MoEStats.load(tmp_path / "run" / "stats.safetensors")
    assert stats.num_tokens == 4 * 64  # two blocks per process
    assert ompmoe.PruningPlan.load(tmp_path / "run" / "plan.json").achieved_ratio == pytest.approx(0.5)


def test_validate_and_test_run_with_their_command_in_sys_argv(monkeypatch):
    """``ompmoe validate`` on several devices hung as fit did: its run saw a bare sys.argv, which Lightning runs again
    to start the other ranks. The evaluation runs with the command in sys.argv too (bare only while parsing)."""
    import sys

    from ompmoe.cli import lightning_cli

    seen = []
    monkeypatch.setattr("ompmoe.eval.cli.eval_cli", lambda args: seen.append((list(sys.argv), args)))
    for command in ("validate", "test"):
        lightning_cli([command, "-c", "configs/eval/tiny.yaml", "--trainer.devices", "2"])
    assert seen == [([sys.argv[0], command, "-c", "configs/eval/tiny.yaml", "--trainer.devices", "2"],
                     [command, "-c", "configs/eval/tiny.yaml", "--trainer.devices", "2"])
                    for command in ("validate", "test")]
