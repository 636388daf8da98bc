"""``ompmoe prune --model`` compensates as the fit did: the fit's calibration text cut again from the data settings its
plan recorded, the same fit and check as the run's step, or a clear refusal before any work."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import ompmoe
from ompmoe.cli import main
from ompmoe.engine.apply.compensation_step import fit_compensation
from ompmoe.engine.tiny import tiny_model

MODEL = "tiny:qwen3_moe"
DATA = dict(source="shipped:mix", tokenizer="bytes", seq_len=32, num_blocks=8, batch_size=4)


def calibration_data() -> ompmoe.CalibrationDataModule:
    return ompmoe.CalibrationDataModule(**DATA)


@pytest.fixture(scope="module")
def fit(tmp_path_factory) -> Path:
    """A fit's output (``auto``, so compensated and checked), as the callback writes it, made through the run."""
    out = tmp_path_factory.mktemp("fit") / "run"
    data = calibration_data()
    auto = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto", min_kept_fraction=0.25)
    run = ompmoe.PruningRun(ompmoe.RunOptions(strategy=auto, output_dir=str(out), plots=False, save_model=False,
                                              choice_blocks=2))
    context = ompmoe.LocalContext(print=lambda line: None)
    run.start(tiny_model("qwen3_moe"), context, model_id=MODEL, data=data)
    run.collect(data.blocks.split(4))
    run.finish(context)
    return out


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=calibration_data().blocks[:2]).logits


def saved(path: Path) -> torch.nn.Module:
    return ompmoe.load_pruned(path, dtype=torch.float32)  # per-layer expert counts: not a stock layout


def test_the_fit_records_its_data_settings_with_its_compensation(fit):
    record = json.loads((fit / "plan.json").read_text())["extra"]["compensation"]
    assert record["calibration_data"] == {key: value for key, value in DATA.items() if key != "batch_size"} | {
        "data_files": None, "text_field": None, "split": "train", "seed": None}
    assert record["checked"] == "held-out calibration loss" and record["fitted"] == "down"
    assert record["granularity"] == ("linear" if min(record["tried"], key=record["tried"].get) == "linear" else "down")


@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_prune_fits_the_fits_compensation_on_the_same_text_and_saves_the_literal_model(fit, tmp_path, ratio, capsys):
    main(["prune", "--stats", str(fit / "stats.safetensors"), "--ratio", str(ratio), "--model", MODEL,
          "--output_dir", str(tmp_path / "out")])
    plan = ompmoe.PruningPlan.load(tmp_path / "out" / f"plan-{ratio:g}.json")
    record = plan.extra["compensation"]
    data = calibration_data()
    original = tiny_model("qwen3_moe")
    bare = ompmoe.PruningPlan(**{**plan.__dict__, "extra": {}})
    compensation, literal = fit_compensation(original, bare, data.blocks, 4, "down", data.choice_blocks(2))
    assert {key: record[key] for key in literal} == literal  # the same fit, the same check
    if ratio == 0.5:  # the fit's own ratio: the fit's numbers again
        fitted = json.loads((fit / "plan.json").read_text())["extra"]["compensation"]
        assert (record["loss_without"], record["loss_with"]) == (fitted["loss_without"], fitted["loss_with"])
    expected = ompmoe.prune(copy.deepcopy(original), bare)
    if compensation is not None:
        compensation.apply(expected)
    torch.testing.assert_close(logits(saved(tmp_path / "out" / f"model-{ratio:g}")), logits(expected),
                               rtol=1e-5, atol=1e-5)
    verdict = "applied" if record["applied"] else "not applied (it raised the loss by more than 0.02)"
    fitted = "linear" if record["granularity"] == "linear" else f"down, alpha {record['ridge_alpha']:g}"
    assert (f"ratio {ratio:g}: compensation ({fitted}, {record['num_tokens']} tokens): held-out calibration loss "
            f"{record['loss_without']:.4f} -> {record['loss_with']:.4f}, {verdict}") in capsys.readouterr().out


def test_prune_with_compensation_off_saves_the_plain_pruned_model(fit, tmp_path):
    main(["prune", "--stats", str(fit / "stats.safetensors"), "--ratio", "0.5", "--model", MODEL,
          "--output_dir", str(tmp_path / "out"), "--compensation", "off"])
    plan = ompmoe.PruningPlan.load(tmp_path / "out" / "plan-0.5.json")
    assert "compensation" not in plan.extra
    expected = ompmoe.prune(tiny_model("qwen3_moe"), plan)
    torch.testing.assert_close(logits(saved(tmp_path / "out" / "model-0.5")), logits(expected), rtol=0, atol=0)


def prune_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["prune", *argv])
    assert info.value.code == 2
    return capsys.readouterr().err


def test_compensation_that_cannot_be_done_is_refused_before_any_work(fit, tmp_path, capsys):
    stats = str(fit / "stats.safetensors")
    out = tmp_path / "out"
    assert prune_error(capsys, "--stats", stats, "--ratio", "0.5", "--output_dir", str(out), "--compensation",
                       "linear") == ("error: --compensation refits the pruned models' experts: give --model (plans "
                                     "alone hold no weights)\n")
    assert prune_error(capsys, "--stats", stats, "--ratio", "0.5", "--output_dir", str(out), "--compensation",
                       "linaer") == ("error: --compensation must be off, layer, expert, linear, down; got 'linaer' (the "
                                     "default: off with a method named, else what the fit applied)\n")
    assert not out.exists()


def test_a_fit_without_recorded_data_settings_is_named_and_its_prune_left_uncompensated(fit, tmp_path, capsys):
    copied = tmp_path / "fit"
    copied.mkdir()
    (copied / "stats.safetensors").write_bytes((fit / "stats.safetensors").read_bytes())
    plan = json.loads((fit / "plan.json").read_text())
    for record in (plan["extra"], plan["extra"]["compensation"], plan["extra"].get("heldout", {})):
        record.pop("calibration_data", None)  # e.g. a fit on a plain DataLoader: no record of its text anywhere
    (copied / "plan.json").write_text(json.dumps(plan))
    stats, out = str(copied / "stats.safetensors"), tmp_path / "out"
    where = (f"the fit's plan {copied / 'plan.json'} records no calibration data settings to cut it again (its text "
             "came from elsewhere than ompmoe.CalibrationDataModule)")
    assert prune_error(capsys, "--stats", stats, "--ratio", "0.5", "--model", MODEL, "--output_dir", str(out),
                       "--compensation", "layer") == (f"error: --compensation layer fits on the fit's calibration "
                                                      f"text, but {where}; pass --compensation off\n")
    assert not out.exists()
    main(["prune", "--stats", stats, "--ratio", "0.5", "--model", MODEL, "--output_dir", str(out)])
    assert f"ompmoe prune: the fit compensated its model, these are not: {where}\n" in capsys.readouterr().out
    assert "compensation" not in ompmoe.PruningPlan.load(out / "plan-0.5.json").extra


def test_a_method_named_runs_as_published_without_the_fits_allocation_or_compensation(fit, tmp_path, capsys):
    """The fit compensated (``auto``); ``--method reap`` is REAP as its authors run it: uniform, uncompensated."""
    main(["prune", "--stats", str(fit / "stats.safetensors"), "--ratio", "0.5", "--model", MODEL,
          "--output_dir", str(tmp_path / "out"), "--method", "reap"])
    plan = ompmoe.PruningPlan.load(tmp_path / "out" / "plan-0.5.json")
    stats = ompmoe.MoEStats.load(fit / "stats.safetensors")
    assert plan == ompmoe.plan_pruning(stats, 0.5, method="reap", allocation="uniform", min_kept_fraction=0.25)
    expected = ompmoe.prune(tiny_model("qwen3_moe"), plan)
    torch.testing.assert_close(logits(saved(tmp_path / "out" / "model-0.5")), logits(expected), rtol=0, atol=0)
    assert capsys.readouterr().out.splitlines() == [
        "ompmoe prune: method reap (option), allocation uniform (reap's own), compensation off (none for a named "
        "method), risk_weight 3, min_kept_fraction 0.25, max_kept_fraction 0.875, zeta 1e-06 (risk_weight, "
        f"min_kept_fraction, max_kept_fraction, zeta from the fit's plan {fit / 'plan.json'})",
        f"ratio 0.5: {ompmoe.kept_summary(plan)} -> {tmp_path / 'out' / 'model-0.5'}"]


def test_prune_measures_heldout_perplexity_per_ratio_on_the_fits_text(fit, tmp_path, capsys):
    main(["prune", "--stats", str(fit / "stats.safetensors"), "--ratio", "0.25,0.5", "--model", MODEL,
          "--output_dir", str(tmp_path / "out"), "--method", "omp", "--evaluate_on", "heldout:prose,heldout:code",
          "--evaluate_blocks", "3"])
    data = calibration_data()  # the fit's tokenizer and seq_len, from its plan
    blocks = {name: data.heldout_blocks(name, 3) for name in ("heldout:prose", "heldout:code")}
    original = {name: ompmoe.perplexity(tiny_model("qwen3_moe"), block) for name, block in blocks.items()}
    lines = capsys.readouterr().out.splitlines()
    for ratio in (0.25, 0.5):
        plan = ompmoe.PruningPlan.load(tmp_path / "out" / f"plan-{ratio:g}.json")
        assert plan.extra["heldout"] == {"sets": ["heldout:prose", "heldout:code"], "blocks": 3,
                                         "calibration_data": json.loads((fit / "plan.json").read_text())[
                                             "extra"]["compensation"]["calibration_data"]}
        pruned = ompmoe.prune(tiny_model("qwen3_moe"), plan)
        after = {name: ompmoe.perplexity(pruned, block) for name, block in blocks.items()}
        assert (f"ratio {ratio:g}: held-out perplexity on {3 * 32:,} tokens per set, original -> pruned: "
                + ", ".join(f"{name} {original[name]:.2f} -> {after[name]:.2f}" for name in blocks)) in lines
    assert prune_error(capsys, "--stats", str(fit / "stats.safetensors"), "--ratio", "0.5", "--output_dir",
                       str(tmp_path / "plans"), "--evaluate_on", "heldout:prose") == (
        "error: --evaluate_on measures the pruned models: give --model (plans alone hold no weights)\n")


def test_a_saved_weights_dtype_is_checked_before_any_work(fit, tmp_path, capsys, monkeypatch):
    """``--dtype float8`` ran the whole job (calibration, trial, refit, held-out perplexity) and failed at the write;
    without --model, --dtype and --tokenizer were ignored. Both are refused first, naming the option."""
    from ompmoe.callbacks import ExpertPruning

    stats = str(fit / "stats.safetensors")
    monkeypatch.setattr("ompmoe.lightning.models.load_model", None)  # any load would fail
    assert prune_error(capsys, "--stats", stats, "--ratio", "0.5", "--model", MODEL, "--dtype", "float8",
                       "--output_dir", str(tmp_path / "out")) == (
        "error: Unknown --dtype 'float8' for the saved weights; use e.g. 'bfloat16', 'float16' or 'float32' (or "
        "leave it out: the source's).\n")
    for option, value in (("--dtype", "bfloat16"), ("--tokenizer", str(tmp_path / "nowhere"))):
        assert prune_error(capsys, "--stats", stats, "--ratio", "0.5", option, value, "--output_dir",
                           str(tmp_path / "out")) == (
            f"error: {option} applies to the models prune writes: give --model (plans alone hold no weights)\n")
    assert not (tmp_path / "out").exists()
    message = ("Unknown dtype 'int8' for the saved weights; use e.g. 'bfloat16', 'float16' or 'float32' (or leave it "
               "out: the source's).")
    with pytest.raises(ValueError) as refused:
        ExpertPruning(dtype="int8")
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:
        ompmoe.RunOptions(dtype=torch.int8)
    assert str(refused.value) == message.replace("'int8'", "'torch.int8'")


def test_a_fit_that_compensated_nothing_is_refitted_on_its_recorded_calibration_text(fit, tmp_path, capsys):
    """A fit without compensation (a named method, ``compensation off``) recorded no data settings, so
    ``prune --compensation`` was refused saying its text came from elsewhere than CalibrationDataModule. Every fit on
    it records them now (``extra.calibration_data``); an older fit's held-out record serves too."""
    plan = json.loads((fit / "plan.json").read_text())
    data = plan["extra"]["calibration_data"]
    assert data == plan["extra"]["compensation"]["calibration_data"]
    del plan["extra"]["compensation"]
    plans = {"now": dict(plan, extra={key: value for key, value in plan["extra"].items() if key != "heldout"}),
             "older": dict(plan, extra={**{key: value for key, value in plan["extra"].items()
                                           if key != "calibration_data"}, "heldout": {"sets": [], "blocks": 2,
                                                                                    "calibration_data": data}})}
    for name, recorded in plans.items():
        copied = tmp_path / name
        copied.mkdir()
        (copied / "stats.safetensors").write_bytes((fit / "stats.safetensors").read_bytes())
        (copied / "plan.json").write_text(json.dumps(recorded))
        main(["prune", "--stats", str(copied / "stats.safetensors"), "--ratio", "0.5", "--model", MODEL,
              "--output_dir", str(tmp_path / f"out-{name}"), "--compensation", "layer", "--quiet"])
        record = ompmoe.PruningPlan.load(tmp_path / f"out-{name}" / "plan-0.5.json").extra["compensation"]
        assert record["granularity"] == "layer" and record["calibration_data"] == data


def test_the_recorded_data_settings_are_json_whatever_the_data_module_was_given():
    """Every fit records its data settings now: a tokenizer object (or a Path) given to the data module from Python
    would have made plan.save fail after the whole run. A tokenizer is recorded by its name or path."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from ompmoe.engine.apply.compensation_step import calibration_data
    from ompmoe.engine.names import shipped_model_path

    tokenizer = AutoTokenizer.from_pretrained(shipped_model_path())
    settings = calibration_data(SimpleNamespace(hparams={
        "source": "shipped:mix", "tokenizer": tokenizer, "data_files": [Path("a.txt")], "seq_len": 64,
        "batch_size": 4, "_private": 1}))
    assert settings == {"source": "shipped:mix", "tokenizer": str(shipped_model_path()), "data_files": ["a.txt"],
                        "seq_len": 64}
    assert json.loads(json.dumps(settings)) == settings
