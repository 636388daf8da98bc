"""Calibrate and prune with Lightning Fabric: ``ompmoe fit -c configs/tiny.yaml``'s job as a Fabric script.

Run it under ``fabric run`` (a script path, not ``-m``: ``--path`` prints it) or let it start its own processes.
Its options are ``ompmoe fit``'s, built from the same declarations, with ``configs/tiny.yaml``'s defaults;
``--strategy fsdp`` means FSDP2 per decoder layer (Fabric's FSDP1 cannot slice experts): docs/usage.md, "Fabric".
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file (fabric run PATH): its folder must not shadow modules
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _here]

from typing import Any, Literal  # noqa: E402

TINY_JOB = {"model.model": "shipped:tiny-moe", "data.source": "shipped:mix", "data.seq_len": 256,
            "data.num_blocks": 16, "data.batch_size": 4, "output_dir": "outputs/tiny", "method": "auto",
            "allocation": "auto", "evaluate_on": ["heldout:prose", "heldout:code"]}
"""configs/tiny.yaml's job (an existing ``--output_dir`` is still replaced only with ``--overwrite``)."""


def parser() -> Any:
    """The script's options: ``fit``'s model, data and pruning options (one declaration each), and Fabric's."""
    from jsonargparse import ArgumentParser

    from ..cli_args import add_run_options
    from ..cli_options import PARSER_SETTINGS
    from .calibration_data import CalibrationDataModule
    from .calibration_module import CalibrationModule

    p = ArgumentParser(prog="python -m ompmoe.lightning.fabric_prune", **PARSER_SETTINGS,
                       description="Calibrate and prune an MoE model with Lightning Fabric (DDP or FSDP2), as "
                                   "`ompmoe fit` does.")
    p.add_argument("--path", action="store_true", help="print this script's path (for `fabric run PATH`) and exit")
    p.add_class_arguments(CalibrationModule, "model")
    p.add_class_arguments(CalibrationDataModule, "data")
    add_run_options(p)
    p.add_argument("--accelerator", type=str | None, default=None, help="cpu, cuda, gpu, mps, auto")
    p.add_argument("--devices", type=str | None, default=None, help="processes per node, e.g. 2")
    p.add_argument("--num_nodes", type=int | None, default=None)
    p.add_argument("--strategy", type=Literal["auto", "ddp", "fsdp", "single_device"] | None, default=None,
                   help="fsdp: FSDP2 per decoder layer")
    p.add_argument("--precision", type=str | None, default=None, help="Fabric's precision, e.g. bf16-mixed")
    p.add_argument("--seed_everything", type=int, default=0)
    p.set_defaults(TINY_JOB)
    return p


def _fabric_strategy(name: str | None, devices: str | None, num_nodes: int | None) -> Any:
    """The Fabric strategy: ``fsdp`` becomes FSDP2 per decoder layer (``ModelParallelStrategy``), others stay names.
    Under ``fabric run --strategy fsdp`` the CLI's choice arrives as ``LT_STRATEGY``; it is taken over here (Fabric
    would refuse a strategy object that differs from the CLI's name)."""
    name = name or os.environ.get("LT_STRATEGY")
    if name != "fsdp":
        return name or "auto"
    os.environ.pop("LT_STRATEGY", None)
    from lightning.fabric.strategies import ModelParallelStrategy

    from .fabric import fsdp2

    if "WORLD_SIZE" in os.environ:  # started by fabric run / torchrun
        world_size = int(os.environ["WORLD_SIZE"])
    else:
        count = devices or os.environ.get("LT_DEVICES") or "1"
        if not count.isdigit():
            raise ValueError(f"--strategy fsdp needs --devices as a number of processes; got {count!r}.")
        world_size = int(count) * int(num_nodes or os.environ.get("LT_NUM_NODES") or 1)
    return ModelParallelStrategy(parallelize_fn=fsdp2, data_parallel_size=world_size, tensor_parallel_size=1)


def main(argv: list[str] | None = None) -> Any:
    """Parse ``argv``, calibrate, prune and write; returns the :class:`~ompmoe.FabricCalibration` (for tests)."""
    from ..cli_args import bare_flags, parse_or_raise, run_from_arguments

    p = parser()
    argv = bare_flags(sys.argv[1:] if argv is None else argv, ("overwrite",))  # --overwrite alone: true
    args = parse_or_raise(p, argv, "python -m ompmoe.lightning.fabric_prune")
    if args.path:
        print(os.path.abspath(__file__))
        return None
    from lightning.fabric import Fabric

    from ..engine.io import inputs_of
    from .fabric import FabricCalibration, fabric_context

    instantiate = getattr(p, "instantiate", None) or p.instantiate_classes  # jsonargparse 4.49 renamed it
    classes = instantiate(args)  # checks the model name and the data source, reads nothing yet
    module, datamodule = classes.model, classes.data
    if datamodule.tokenizer is None:
        datamodule.tokenizer = module.tokenizer_name
    options = {key: args[key] for key in ("accelerator", "devices", "num_nodes", "precision") if args[key] is not None}
    fabric = Fabric(strategy=_fabric_strategy(args.strategy, args.devices, args.num_nodes), **options)
    if os.environ.get("LT_CLI_USED") != "1":  # fabric run has started the processes already
        fabric.launch()
    fabric.seed_everything(args.seed_everything)
    # every option checked before the model loads; FabricCalibration takes this run as it is
    run = run_from_arguments(args, "FabricCalibration", module.tokenizer_name)
    run.check_output(fabric_context(fabric), inputs_of(module, datamodule))
    datamodule.prepare_data()  # a hub data set that cannot be had fails here, before the model loads
    module.configure_model()
    model = fabric.setup(module.model.eval())
    calibration = FabricCalibration(fabric, model, model_id=module.model_name_or_path,
                                    sources=[datamodule.describe()], data=datamodule, pruning=run)
    datamodule.setup("fit")
    calibration.run(fabric.setup_dataloaders(datamodule.train_dataloader()))
    calibration.finish()
    return calibration


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` as a command: a user error is one ``error:`` line (from the first rank) and exit status 2."""
    from ..cli_args import user_errors

    try:
        main(argv)
    except user_errors() as error:
        if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # the calibration loop printed its line; 130 as a shell reports Ctrl-C
        raise SystemExit(130) from None


if __name__ == "__main__":
    if __package__:
        cli()
    else:  # run as a file: import it as the package module, so its relative imports resolve
        from ompmoe.lightning.fabric_prune import cli as package_cli

        package_cli()
