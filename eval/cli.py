"""``ompmoe validate`` / ``ompmoe test``: LightningCLI with EvalModule and LMEvalDataModule.

``ompmoe fit`` keeps the calibration CLI (CalibrationModule + CalibrationDataModule); the
evaluation subcommands get their own LightningCLI so their configs name an evaluation model and
suite (``configs/eval/*.yaml``).
"""

from __future__ import annotations

EVAL_SUBCOMMANDS = ("validate", "test")


def eval_cli(args: list[str] | None = None) -> None:
    from lightning.pytorch.cli import LightningCLI

    from .datamodule import LMEvalDataModule
    from .module import EvalModule

    LightningCLI(EvalModule, LMEvalDataModule, save_config_kwargs={"overwrite": True}, args=args)
