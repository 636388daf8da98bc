"""Every ``ompmoe`` command prints only ompmoe's own lines on stderr, with the ``recipes`` extra installed.

torchao (installed in the test environment) makes transformers print kernel-loading failures and torch
pytree deprecations on import; Hugging Face draws weight-loading bars into log files; Lightning prints
tips and accelerator summaries. None of it is actionable for a user of the command (ompmoe/_quiet.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ompmoe

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent


OWN_WARNING = re.compile(re.escape(str(Path(ompmoe.__file__).parents[1])) + r"/(ompmoe|callbacks|eval)/\S+\.py:\d+: ")


def foreign_lines(stderr: str) -> list[str]:
    """Lines that are neither ompmoe's ``ompmoe...`` messages nor its one-line ``warning: ...`` (the commands print
    warnings raised in ompmoe's source so) nor, from a command that does not, such a warning's first line."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(("ompmoe", "warning: ")) and not OWN_WARNING.match(line)]


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stderr[-3000:]}"
    return done


def test_quiet_third_party_drops_the_import_noise_of_torchao():
    pytest.importorskip("torchao")  # the test extra installs it, so the noise is there to drop
    loud = subprocess.run([sys.executable, "-c", "import torchao"], capture_output=True, text=True, timeout=600)
    assert "Failed to load" in loud.stderr or "Enum subclass" in loud.stderr, loud.stderr
    quiet = subprocess.run([sys.executable, "-c", "from ompmoe._quiet import quiet_third_party\n"
                            "quiet_third_party()\nimport torchao"], capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0 and quiet.stderr == ""


@pytest.mark.slow
def test_every_command_keeps_stderr_to_its_own_lines(tmp_path):
    for shared in ("configs", "tests"):
        (tmp_path / shared).symlink_to(ROOT / shared)
    commands = [
        ["ompmoe", "fit", "-c", "configs/tiny.yaml", "--data.num_blocks", "4", "--trainer.callbacks.output_dir", "run"],
        ["ompmoe", "prune", "--stats", "run/stats.safetensors", "--ratio", "0.25", "--output_dir", "plans",
         "--model", "shipped:tiny-moe"],
        ["ompmoe", "plot", "--stats", "run/stats.safetensors", "--output_dir", "plots"],
        ["ompmoe", "validate", "-c", "configs/eval/tiny.yaml", "--data.output_path", "eval/original.json",
         "--trainer.logger", "false"],
        ["ompmoe", "report", "eval/original.json"],
        ["ompmoe-demo", "--output_dir", "demo", "--num_blocks", "4"],
        [sys.executable, "-m", "ompmoe.lightning.finetune_module", "fit", "--model.model", "run/model",
         "--model.save_dir", "finetuned", "--model.lora_rank", "4",
         "--model.teacher", "shipped:tiny-moe", "--data.tokenizer", "run/model", "--data.seq_len", "32",
         "--data.num_blocks", "4", "--data.batch_size", "2", "--data.val_sources", "[shipped:prose]",
         "--data.val_blocks", "1", "--trainer.max_steps", "2", "--trainer.accelerator", "cpu",
         "--trainer.enable_checkpointing", "false", "--trainer.logger", "false"],
    ]
    for command in commands:
        done = run(command, tmp_path)
        assert foreign_lines(done.stderr) == [], f"{' '.join(command)} printed:\n{done.stderr}"


def test_ompmoe_warnings_are_one_line_and_others_keep_their_format():
    code = ("import warnings\nfrom ompmoe._quiet import quiet_third_party\nquiet_third_party()\n"
            "import ompmoe.engine.planning.plan as plan\n"
            "warnings.warn_explicit('ours', UserWarning, plan.__file__, 1)\n"
            "warnings.warn_explicit('theirs', UserWarning, warnings.__file__, 1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = done.stderr.splitlines()
    assert lines[0] == "warning: ours" and lines[1].startswith(f"{warnings_file()}:1: UserWarning: theirs"), done.stderr


def warnings_file() -> str:
    import warnings

    return warnings.__file__


def test_quiet_quiets_its_own_command_only(monkeypatch, capsys):
    """``--quiet`` sets Lightning's info loggers to warnings and switches transformers' bars off while its command
    runs, and puts both back after it, also when it fails: a later fit in the same process (a notebook, a test
    worker) prints its ``ompmoe:`` lines again."""
    import logging

    from transformers.utils import logging as hf_logging

    from ompmoe import cli
    from ompmoe._quiet import LIGHTNING_LOGGERS

    levels = lambda: [logging.getLogger(name).level for name in LIGHTNING_LOGGERS]  # noqa: E731
    bars, before = hf_logging.is_progress_bar_enabled(), levels()
    hf_logging.enable_progress_bar()
    try:
        with pytest.raises(SystemExit):  # the real command, refused while parsing
            cli.main(["fit", "--quiet", "--no_such_option", "1"])
        assert "no_such_option" in capsys.readouterr().err
        assert levels() == before  # (main itself turns the bars off where stderr is no terminal)

        hf_logging.enable_progress_bar()
        seen = []
        monkeypatch.setattr(cli, "_lightning_cli", lambda args, given: seen.append(
            (levels(), hf_logging.is_progress_bar_enabled(), args)))
        cli.lightning_cli(["fit", "--quiet"])
        cli.lightning_cli(["fit"])
        assert seen == [([logging.WARNING] * len(LIGHTNING_LOGGERS), False,
                         ["fit", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]),
                        (before, True, ["fit"])]
        assert levels() == before and hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
