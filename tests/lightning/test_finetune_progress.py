"""Fine-tuning progress in a log file: plain ``ompmoe: fine-tuning step ...`` lines with the step, loss and time left.

A progress bar draws nothing useful into a file (under ``python -m ompmoe.lightning.finetune_module`` none at all:
the command turns tqdm off when stderr is not a terminal), and the documented recipe runs for many minutes on CPU.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import ompmoe
from ompmoe.lightning.finetune_module import ProgressLines, _duration

DURATION = r"(?:\d+s|\d+m\d\ds|\d+h\d\dm)"
LINE = re.compile(rf"ompmoe: fine-tuning step (?P<step>\d+)/(?P<total>\d+), loss (?P<loss>\d+\.\d{{4}}), "
                  rf"(?P<elapsed>{DURATION}) elapsed(?:, about (?P<left>{DURATION}) left)?")


def test_durations_read_as_minutes_and_seconds():
    assert [_duration(s) for s in (0, 44.6, 60, 245, 3599, 3600, 3725)] == [
        "0s", "45s", "1m00s", "4m05s", "59m59s", "1h00m", "1h02m"]
    with pytest.raises(ValueError):
        ProgressLines(every_seconds=0)


def test_the_finetuning_command_writes_progress_lines_into_a_log_file(tmp_path):
    """What a user runs in a batch job (output to a file): the command's whole stderr is its progress lines."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    env.pop("TQDM_DISABLE", None)
    command = [sys.executable, "-m", "ompmoe.lightning.finetune_module", "fit", "--model.model", "shipped:tiny-moe",
               "--model.lora_rank", "4", "--model.learning_rate", "1e-3",
               "--model.keep_best", "false", "--data.seq_len", "32",  # keep_best: no restore warning on 3 steps
               "--data.num_blocks", "6", "--data.batch_size", "2", "--data.val_sources", "[shipped:prose]",
               "--data.val_blocks", "1", "--trainer.max_epochs", "1", "--trainer.accelerator", "cpu",
               "--trainer.enable_checkpointing", "false", "--trainer.logger", "false"]
    log = tmp_path / "finetune.log"
    with open(tmp_path / "stdout.log", "w") as out, open(log, "w") as err:
        done = subprocess.run(command, cwd=tmp_path, env=env, stdout=out, stderr=err, timeout=900)
    stderr = log.read_text()
    assert done.returncode == 0, stderr
    lines = stderr.splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert lines and all(matches), f"stderr holds other lines than the progress lines:\n{stderr}"
    steps = [int(m["step"]) for m in matches]
    assert steps[0] == 1 and steps[-1] == 3 and steps == sorted(set(steps)), stderr  # 6 blocks of 2: 3 steps
    assert {int(m["total"]) for m in matches} == {3}
    assert all(m["left"] for m in matches[:-1]) and matches[-1]["left"] is None, stderr  # nothing left at the end
    assert all(0 < float(m["loss"]) < 20 for m in matches)


def test_lines_give_the_mean_loss_since_the_last_line_and_the_time_left(monkeypatch):
    clock = iter(range(0, 10_000, 5))  # every reading of the clock is 5 s after the previous one
    monkeypatch.setattr(ProgressLines, "clock", staticmethod(lambda: float(next(clock))))
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    torch.manual_seed(0)
    stream = io.StringIO()
    module = ompmoe.FinetuneModule("tiny:qwen3_moe", learning_rate=1e-3)
    data = ompmoe.FinetuneDataModule("shipped:mix", tokenizer="bytes", seq_len=16, num_blocks=8, batch_size=1,
                                     val_blocks=1)
    trainer = pl.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[Losses(), ProgressLines(every_n_steps=3, stream=stream)])
    trainer.fit(module, data)
    matches = [LINE.fullmatch(line) for line in stream.getvalue().splitlines()]
    assert all(matches), stream.getvalue()
    assert [int(m["step"]) for m in matches] == [1, 3, 6, 8]  # the first step, every 3rd, the last
    assert [float(m["loss"]) for m in matches] == [
        pytest.approx(sum(part) / len(part), abs=6e-5) for part in (losses[:1], losses[1:3], losses[3:6], losses[6:])]
    # The clock: on_train_start 0 s, first batch 5 s, then one reading per step (10 s, 15 s, ...); the first line's
    # rate counts from the first batch, later ones from the first line, so the first step's extra costs drop out.
    assert [m["elapsed"] for m in matches] == ["10s", "20s", "35s", "45s"]
    assert [m["left"] for m in matches] == ["35s", "25s", "10s", None]


def test_the_module_adds_progress_lines_only_where_a_bar_cannot_be_seen(monkeypatch):
    module = ompmoe.FinetuneModule("tiny:qwen3_moe")
    for bar, tty, expected in ((True, False, [ProgressLines]), (False, False, []), (True, True, [])):
        module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                                    enable_progress_bar=bar, enable_model_summary=False)
        monkeypatch.setattr(sys.stderr, "isatty", lambda tty=tty: tty)
        assert [type(callback) for callback in module.configure_callbacks()] == expected
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                                callbacks=[ProgressLines(every_seconds=5)])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert module.configure_callbacks() == []  # the user's own settings stay


def test_the_documented_recipe_names_the_progress_lines():
    text = (Path(__file__).parents[2] / "docs" / "recipes.md").read_text()
    assert "ompmoe: fine-tuning step " in text
