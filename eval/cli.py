"""``ompmoe validate`` / ``ompmoe test``: a LightningCLI of EvalModule and LMEvalDataModule (``configs/eval/``)."""

from __future__ import annotations

from typing import Any

EVAL_SUBCOMMANDS = ("validate", "test")


def eval_cli(args: list[str] | None = None) -> None:
    """Run the evaluation LightningCLI (``fit`` keeps the calibration CLI)."""
    from lightning.pytorch.cli import LightningCLI

    from ..cli_options import OneLineErrors
    from .datamodule import LMEvalDataModule
    from .module import EvalModule
    from .results import check_results_output

    class EvalCLI(OneLineErrors, LightningCLI):
        """No abbreviated options; a mistyped one is one error line with the option meant. ``--overwrite`` (as on
        every ompmoe command; bare means true) is ``--data.overwrite``; an existing results file is refused before
        any class is built (the model, the tasks), not after the whole evaluation."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument("--overwrite", type=bool | None, default=None,
                                help="replace an existing results file (--data.output_path); a bare --overwrite "
                                     "means true (sets --data.overwrite)")

        def before_instantiate_classes(self) -> None:
            config = self.config.get(self.subcommand, self.config)
            overwrite = config.pop("overwrite", None)
            if overwrite is not None:
                config["data.overwrite"] = overwrite
            data = config.get("data")
            check_results_output(data.get("output_path"), bool(data.get("overwrite")),
                                 inputs=(data.get("include_path"), data.get("data_dir"),
                                         config.get("model.model"), config.get("model.tokenizer")))

    cli = EvalCLI(EvalModule, LMEvalDataModule, save_config_kwargs={"overwrite": True}, args=args)
    written = cli.datamodule.written  # set on rank 0, which writes
    if written is not None:
        print(f"ompmoe {cli.subcommand}: wrote results to {written}", flush=True)
