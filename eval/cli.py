"""``ompmoe validate`` / ``ompmoe test``: a LightningCLI of EvalModule and LMEvalDataModule (``configs/eval/``)."""

from __future__ import annotations

EVAL_SUBCOMMANDS = ("validate", "test")


def eval_cli(args: list[str] | None = None) -> None:
    """Run the evaluation LightningCLI (``fit`` keeps the calibration CLI)."""
    from lightning.pytorch.cli import LightningCLI

    from ..cli_options import OneLineErrors
    from .datamodule import LMEvalDataModule
    from .module import EvalModule

    class EvalCLI(OneLineErrors, LightningCLI):
        """No abbreviated options; a mistyped one is one error line with the option meant."""

    EvalCLI(EvalModule, LMEvalDataModule, save_config_kwargs={"overwrite": True}, args=args)
