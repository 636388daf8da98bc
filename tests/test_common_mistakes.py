"""The common mistakes of a first session each end in one ``error:`` line (exit status 2) that names the fix."""

from __future__ import annotations

import pytest
import torch

from ompmoe.cli import main
from ompmoe.data import resolve_shipped


def run(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_missing_config_file_names_the_close_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.yaml").write_text("seed_everything: 0\n")
    assert run(["fit", "-c", "configs/tiny.yml"], capsys) == (
        "error: config file 'configs/tiny.yml' does not exist; did you mean 'configs/tiny.yaml'?")
    assert run(["fit", "--config=other/tiny.yaml"], capsys) == "error: config file 'other/tiny.yaml' does not exist"


def test_unknown_shipped_model_lists_the_shipped_names():
    with pytest.raises(ValueError) as error:
        resolve_shipped("shipped:tiny-mo")
    assert str(error.value) == ("unknown shipped model 'shipped:tiny-mo': did you mean 'shipped:tiny-moe'? "
                                "the shipped models are shipped:tiny-moe, shipped:tiny-moe-64, shipped:tiny-moe-a3b")
    with pytest.raises(ValueError, match=r"^unknown shipped model 'shipped:llama': the shipped models are "):
        resolve_shipped("shipped:llama")


def test_missing_local_path_says_so_with_the_nearest_existing_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "tiny" / "model").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as error:
        resolve_shipped("outputs/tiny/modle")
    assert str(error.value) == "path 'outputs/tiny/modle' does not exist; did you mean 'outputs/tiny/model'?"
    with pytest.raises(FileNotFoundError) as error:
        resolve_shipped("outputs/other/run/model")
    assert str(error.value) == "path 'outputs/other/run/model' does not exist; 'outputs' exists"
    assert resolve_shipped("outputs/tiny/model") == "outputs/tiny/model"
    from ompmoe.lightning.models import default_tokenizer, resolve_model

    for call, role in ((lambda: resolve_model("outputs/tiny/modle"), "model path"),
                       (lambda: default_tokenizer("outputs/tiny/model", "outputs/tiny/tok"), "tokenizer path")):
        with pytest.raises(FileNotFoundError) as error:  # the role the path was given in, named
            call()
        assert str(error.value).startswith(f"{role} 'outputs/tiny/")
    assert resolve_shipped("Qwen/Qwen3-30B-A3B") == "Qwen/Qwen3-30B-A3B"  # a hub id stays a hub id


@pytest.mark.parametrize(("model", "expected"), [
    ("shipped:tiny-mo", "error: unknown shipped model 'shipped:tiny-mo': did you mean 'shipped:tiny-moe'? "
                        "the shipped models are shipped:tiny-moe, shipped:tiny-moe-64, shipped:tiny-moe-a3b"),
    ("outputs/tiny/modle", "error: model path 'outputs/tiny/modle' does not exist; did you mean "
                           "'outputs/tiny/model'?"),
])
def test_fit_with_a_mistyped_model_is_one_line(model, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs" / "tiny" / "model").mkdir(parents=True)
    config = tmp_path / "fit.yaml"
    config.write_text("trainer:\n  logger: false\n  enable_checkpointing: false\n")
    with pytest.raises(SystemExit) as done:
        main(["fit", "-c", str(config), "--model.model", model])
    assert done.value.code == 2
    assert capsys.readouterr().err == expected + "\n"  # before the Trainer starts: nothing else printed


def test_a_hub_model_neither_cached_nor_reachable_is_one_line_in_fit_and_prune(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # As when the variable is set before the process starts (huggingface_hub reads it once, at import): no request
    # is tried (each would wait out its retries, 23 s, here where nothing is reachable).
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    config = tmp_path / "fit.yaml"
    config.write_text("trainer:\n  logger: false\n  enable_checkpointing: false\n")
    expected = ("error: cannot load model 'ompmoe-test/no-such-moe' from the Hugging Face hub: offline mode is on "
                "(HF_HUB_OFFLINE) and it is not in the local cache; download it where the hub is reachable "
                "(hf download ompmoe-test/no-such-moe) and pass its local directory, or use shipped:tiny-moe")
    assert run(["fit", "-c", str(config), "--model.model", "ompmoe-test/no-such-moe"], capsys) == expected
    import ompmoe

    model = ompmoe.engine.tiny.tiny_model("qwen3_moe")
    stats = ompmoe.collect_stats(model, [torch.randint(0, 200, (2, 16))], progress=False)
    stats.save(tmp_path / "stats.safetensors")
    assert run(["prune", "--stats", str(tmp_path / "stats.safetensors"), "--ratio", "0.5", "--output_dir",
                str(tmp_path / "plans"), "--model", "ompmoe-test/no-such-moe"], capsys) == expected
    assert not (tmp_path / "plans").exists()


@pytest.mark.parametrize(("command", "expected"), [
    ("fitt", "error: unknown command 'fitt': did you mean 'fit'? the commands are fit, prune, plot, validate, test, "
             "predict, report (see ompmoe --help)"),
    ("bogus", "error: unknown command 'bogus': the commands are fit, prune, plot, validate, test, predict, report "
              "(see ompmoe --help)"),
])
def test_an_unknown_command_names_the_close_one_and_every_command(command, expected, capsys):
    assert run([command, "--help"], capsys) == expected


def test_demo_writes_its_own_directory_and_no_advice_it_cannot_follow(tmp_path, monkeypatch, capsys):
    import warnings

    from ompmoe.engine.export.checkpoint import MissingTokenizerWarning
    from ompmoe.recipes.quickstart import prune_tiny_model

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingTokenizerWarning)  # it would name a hidden temporary and a flag the demo lacks
        prune_tiny_model(model="tiny", model_type="gpt_oss", seq_len=32, num_blocks=4)
    assert (tmp_path / "outputs" / "demo" / "plan.json").is_file()  # not outputs/tiny, the main job's directory
    assert not (tmp_path / "outputs" / "tiny").exists()
    assert ("ompmoe-demo: the random tiny model reads UTF-8 bytes as tokens, so model/ has no tokenizer files"
            in capsys.readouterr().out.splitlines())


def test_load_pruned_on_a_runs_output_directory_points_to_its_model(tmp_path):
    import ompmoe
    from ompmoe.engine.tiny import tiny_model

    (tmp_path / "run").mkdir()
    tiny_model("qwen3_moe").save_pretrained(tmp_path / "run" / "model")
    with pytest.raises(FileNotFoundError) as error:
        ompmoe.load_pruned(tmp_path / "run")
    assert str(error.value) == (f"{tmp_path / 'run'} holds no model (no config.json); model/ does: "
                                f"ompmoe.load_pruned({str(tmp_path / 'run' / 'model')!r})")


def test_a_mistyped_method_or_allocation_gets_a_did_you_mean(capsys, tmp_path):
    from ompmoe.engine.collect.synthetic import synthetic_stats

    stats = synthetic_stats(3, 16, 4).save(tmp_path / "stats.safetensors")
    line = run(["prune", "--stats", str(stats), "--ratio", "0.5", "--method", "omp_normalised",
                "--output_dir", str(tmp_path / "out")], capsys)
    assert line.startswith("error: Unknown method 'omp_normalised' (did you mean 'omp_normalized'?); choose one of [")
    line = run(["prune", "--stats", str(stats), "--ratio", "0.5", "--allocation", "waterfil",
                "--output_dir", str(tmp_path / "out")], capsys)
    assert line.startswith("error: Unknown allocation 'waterfil' (did you mean 'waterfill'?); choose one of [")


# ------------------------------------------------------------------ issue 44, item 7: the weak errors found
SUPPORTED_TYPES = "deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe"


@pytest.mark.parametrize(("model", "shown"), [("./dense", "LlamaForCausalLM"), ("tiny:qwen3", "Qwen3ForCausalLM")])
def test_fit_with_a_dense_model_says_it_is_no_mixture_of_experts(model, shown, tmp_path, monkeypatch, capsys):
    import transformers

    from test_cli import tiny_config

    monkeypatch.chdir(tmp_path)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dense")
    capsys.readouterr()  # transformers' "Writing model shards" bar
    assert run(["fit", "-c", str(tiny_config(tmp_path)), "--model.model", model], capsys) == (
        f"error: model {model} ({shown}) has no MoE layers: ompmoe prunes the routed experts of Mixture-of-Experts "
        f"models; pass a model whose model_type is one of {SUPPORTED_TYPES} (e.g. shipped:tiny-moe or "
        "tiny:qwen3_moe)")
    assert not (tmp_path / "run").exists()


@pytest.fixture
def tiny_run(tmp_path, monkeypatch):
    """``outputs/tiny`` (relative, as a user types it) with statistics and the plan made from them."""
    from ompmoe import plan_pruning
    from ompmoe.engine.collect.synthetic import synthetic_stats

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "outputs" / "tiny"
    run_dir.mkdir(parents=True)
    stats = synthetic_stats(3, 16, 4)
    stats.save(run_dir / "stats.safetensors")
    plan_pruning(stats, 0.5).save(run_dir / "plan.json")
    return run_dir


@pytest.mark.parametrize("flag", ["-c", "--config"])
def test_a_statistics_file_or_plan_given_as_the_config_is_named(flag, tiny_run, capsys):
    what = "(YAML, e.g. configs/tiny.yaml): prune from"
    assert run(["fit", flag, "outputs/tiny/stats.safetensors"], capsys) == (
        f"error: {flag} outputs/tiny/stats.safetensors is ompmoe statistics (stats.safetensors), not a config file "
        f"{what} it with ompmoe prune --stats outputs/tiny/stats.safetensors --ratio R --output_dir DIR")
    assert run(["fit", flag, "outputs/tiny/plan.json"], capsys) == (
        f"error: {flag} outputs/tiny/plan.json is a pruning plan (plan.json), not a config file {what} its "
        "statistics with ompmoe prune --stats outputs/tiny/stats.safetensors --ratio R --output_dir DIR (it reads "
        "this plan's settings)")
    (tiny_run / "stats.safetensors").rename(tiny_run.parent / "stats.safetensors")
    assert run(["validate", flag, "outputs/tiny/plan.json"], capsys) == (
        f"error: {flag} outputs/tiny/plan.json is a pruning plan (plan.json), not a config file {what} the "
        "statistics it was made from with ompmoe prune --stats STATS.safetensors --ratio R --output_dir DIR")


def test_a_mistyped_stats_path_gets_a_did_you_mean(tiny_run, capsys):
    expected = ("error: statistics file 'outputs/tiny/stat.safetensors' does not exist; did you mean "
                "'outputs/tiny/stats.safetensors'?")
    assert run(["prune", "--stats", "outputs/tiny/stat.safetensors", "--ratio", "0.5", "--output_dir",
                "outputs/plans"], capsys) == expected
    assert run(["plot", "--stats", "outputs/tiny/stat.safetensors", "--output_dir", "outputs/plots"],
               capsys) == expected
    assert run(["plot", "--stats", "outputs/tiny/stats.safetensors", "--plan", "outputs/tiny/plans.json",
                "--output_dir", "outputs/plots"], capsys) == (
        "error: plan file 'outputs/tiny/plans.json' does not exist; did you mean 'outputs/tiny/plan.json'?")
    assert not (tiny_run.parent / "plans").exists() and not (tiny_run.parent / "plots").exists()


@pytest.fixture
def pruned_run(tmp_path, monkeypatch):
    """``run/`` as a fit of ``tiny:qwen3_moe`` writes it: its statistics and its pruned model (no tokenizer)."""
    import warnings

    import ompmoe
    from ompmoe.engine.tiny import tiny_model

    monkeypatch.chdir(tmp_path)
    model = tiny_model("qwen3_moe")
    stats = ompmoe.collect_stats(model, [torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))],
                                 model_id="tiny:qwen3_moe", progress=False)
    (tmp_path / "run").mkdir()
    stats.save(tmp_path / "run" / "stats.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer for a byte-token model
        pruned = ompmoe.prune(model, ompmoe.PruningStrategy(ratio=0.5).plan(stats))
        ompmoe.save_pruned(pruned, tmp_path / "run" / "model", tokenizer=None)
    return tmp_path / "run"


def test_a_pruned_model_given_as_the_model_names_the_model_it_was_pruned_from(pruned_run, capsys):
    assert run(["prune", "--stats", "run/stats.safetensors", "--ratio", "0.25", "--model", "run/model",
                "--output_dir", "plans"], capsys) == (
        "error: model run/model was pruned by ompmoe (ratio 0.5 of tiny:qwen3_moe); prune the model it was pruned "
        "from: --model tiny:qwen3_moe")
    assert not (pruned_run.parent / "plans").exists()
    # a fit calibrates the pruned model itself (prune, fine-tune, prune again): not refused, unlike a dense one
    from ompmoe.lightning.calibration_module import CalibrationModule

    assert CalibrationModule("run/model").model_name_or_path == "run/model"


def test_prune_still_prunes_a_pruned_model_again_from_its_own_statistics(pruned_run, capsys):
    import ompmoe

    model = ompmoe.load_pruned(pruned_run / "model")
    own = ompmoe.collect_stats(model, [torch.randint(3, 256, (2, 16))], model_id="run/model", progress=False)
    own.save(pruned_run / "own.safetensors")
    main(["prune", "--stats", "run/own.safetensors", "--ratio", "0.25", "--model", "run/model", "--output_dir",
          "again", "--quiet"])
    assert sorted(path.name for path in (pruned_run.parent / "again").iterdir()) == [
        ".ompmoe-output", "model-0.25", "plan-0.25.json"]


def test_a_missing_statistics_file_and_an_unknown_heldout_set_name_the_cli_way_to_fix_them(tmp_path, capsys):
    """The missing file named only ompmoe.collect_stats(...).save(path); an unknown held-out set listed the presets,
    not the held-out sets (heldout:prose, heldout:code)."""
    import ompmoe
    from ompmoe.engine.tiny import tiny_model

    missing = tmp_path / "nowhere" / "stats.safetensors"
    assert run(["prune", "--stats", str(missing), "--ratio", "0.5", "--output_dir", str(tmp_path / "out")],
               capsys) == (f"error: No statistics file at {missing}; a calibration fit writes one (ompmoe fit -c "
                           "configs/tiny.yaml: outputs/tiny/stats.safetensors), as does "
                           "ompmoe.collect_stats(...).save(path).")
    stats = ompmoe.collect_stats(tiny_model("qwen3_moe"), [torch.randint(3, 200, (2, 16))], progress=False)
    saved = stats.save(tmp_path / "stats.safetensors")
    assert run(["prune", "--stats", str(saved), "--ratio", "0.5", "--model", "tiny:qwen3_moe", "--evaluate_on",
                "heldout:nosuch", "--output_dir", str(tmp_path / "out")], capsys).startswith(
        "error: Unknown calibration source 'heldout:nosuch'. Use a preset (wikitext2, c4, tulu-math, evol-code, "
        "shipped), a shipped corpus domain (heldout:prose, heldout:code for held-out sets), ")
    assert not (tmp_path / "out").exists()
