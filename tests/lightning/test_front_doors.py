"""One run behind every front door: ``ompmoe fit``, the Fabric script and the callback, given the same options,
write the same statistics and the same plan, and print the same summary."""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import ompmoe
from ompmoe.callbacks import ExpertPruning

REPO = Path(__file__).resolve().parents[2]
DATA = ["--data.num_blocks", "4", "--data.seq_len", "64", "--data.batch_size", "2"]
HELDOUT_BLOCKS = 8
"""Blocks per held-out set for every door (512 tokens: the lines are compared, not the numbers)."""
OPTIONS = ["--ratio", "0.25", "--method", "reap"]
"""The issue's command (``--ratio 0.25 --method reap --output_dir``) on less text; ``allocation`` stays ``auto``: reap's
own, uniform."""


def summary(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ompmoe: ") and "wrote" not in line]


@pytest.fixture
def lightning_lines(monkeypatch):
    """What the Trainer's run printed (its rank-zero info lines), whatever logging state earlier tests left."""
    lines: list[str] = []
    monkeypatch.setattr("ompmoe.callbacks.pruning.rank_zero_info", lines.append)
    return lines


@pytest.fixture
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_fit_the_fabric_script_and_the_callback_write_the_same_plan(tmp_path, monkeypatch, capfd, lightning_lines,
                                                                  single_thread):
    from ompmoe.cli import main
    from ompmoe.lightning import fabric_prune

    monkeypatch.chdir(tmp_path)
    main(["fit", "-c", str(REPO / "configs" / "tiny.yaml"), *DATA, *OPTIONS, "--output_dir", "outputs/reap",
          "--trainer.callbacks.init_args.plots", "false", "--trainer.callbacks.init_args.evaluate_blocks",
          str(HELDOUT_BLOCKS), "--trainer.enable_progress_bar", "false"])
    fit_lines = summary("\n".join(lightning_lines))
    lightning_lines.clear()
    fabric_prune.main(["--accelerator", "cpu", "--devices", "1", *DATA, *OPTIONS, "--output_dir", "fabric",
                       "--plots", "false", "--evaluate_blocks", str(HELDOUT_BLOCKS)])
    fabric_lines = summary(capfd.readouterr().out)
    callback = ExpertPruning(ompmoe.PruningStrategy(ratio=0.25, method="reap", allocation="auto"),
                             output_dir="callback", plots=False, evaluate_on=["heldout:prose", "heldout:code"],
                             evaluate_blocks=HELDOUT_BLOCKS)
    pl.seed_everything(0)
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=[callback]).fit(
        ompmoe.CalibrationModule("shipped:tiny-moe"),
        ompmoe.CalibrationDataModule("shipped:mix", seq_len=64, num_blocks=4, batch_size=2))
    callback_lines = summary("\n".join(lightning_lines))

    plans = [ompmoe.PruningPlan.load(Path(out) / "plan.json") for out in ("outputs/reap", "fabric", "callback")]
    assert (plans[0].method, plans[0].allocation, plans[0].ratio) == ("reap", "uniform", 0.25)
    assert plans[0] == plans[1] == plans[2]
    stats = [ompmoe.MoEStats.load(Path(out) / "stats.safetensors") for out in ("outputs/reap", "fabric", "callback")]
    for other in stats[1:]:
        assert other.num_tokens == stats[0].num_tokens == 4 * 64
        for a, b in zip(stats[0].layers, other.layers, strict=True):
            for key, value in a.tensors().items():
                torch.testing.assert_close(b.tensors()[key], value, rtol=1e-10, atol=1e-12)
    # settings (with auto's trial), kept experts and held-out perplexity: the same lines from every door
    assert len(fit_lines) == 3 and fit_lines[2].startswith(
        f"ompmoe: held-out perplexity on {HELDOUT_BLOCKS * 64} tokens per set, original -> pruned: ")
    assert fit_lines == fabric_lines == callback_lines
    assert sorted(os.listdir("fabric")) == [".ompmoe-output", "model", "plan.json", "stats.safetensors"]


def test_fit_takes_the_short_options_only_with_an_expert_pruning_callback(tmp_path, monkeypatch, capfd):
    from ompmoe.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as error:
        main(["fit", "-c", str(REPO / "configs" / "tiny.yaml"), "--trainer.callbacks", "[]", "--ratio", "0.25"])
    assert error.value.code == 2
    assert capfd.readouterr().err.splitlines()[-1] == (
        "error: --ratio sets the ExpertPruning callback's option, but the fit config has no ExpertPruning "
        "callbacks; add one (as configs/tiny.yaml does) or set the option on it as "
        "--trainer.callbacks.init_args.<name>.")
    assert list(tmp_path.iterdir()) == []


def test_the_fabric_script_refuses_a_bad_option_in_one_line_before_any_work(capfd):
    from ompmoe.lightning import fabric_prune

    with pytest.raises(SystemExit) as error:
        fabric_prune.cli(["--ratio", "half"])
    assert error.value.code == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "ratio" in err[0]
    assert err[0].endswith("(see python -m ompmoe.lightning.fabric_prune --help)")
