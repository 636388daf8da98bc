"""Calibrate and prune with Lightning Fabric: ``ompmoe fit -c configs/tiny.yaml``'s job as a Fabric script.

Run it under ``fabric run`` (Lightning 2.6 takes the script's path, not ``-m``)::

    fabric run --accelerator cpu --devices 2 --strategy ddp "$(python -m ompmoe.lightning.fabric_prune --path)" \\
        --output_dir outputs/fabric

or let it start its processes itself (``python -m ompmoe.lightning.fabric_prune --devices 2 --strategy ddp``).
The defaults are ``configs/tiny.yaml``'s, but an existing ``--output_dir`` is replaced only with ``--overwrite``.
``--strategy fsdp`` means FSDP2 per decoder layer: Fabric's own ``fsdp`` is FSDP1, whose flat parameters cannot be
sliced per expert.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file (fabric run PATH): its folder must not shadow modules
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _here]

import argparse  # noqa: E402
from typing import Any  # noqa: E402

STRATEGIES = ("auto", "ddp", "fsdp", "single_device")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true", "32", "16", "bf16", "64")


def _bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false; got {value!r}")


def _ratios(value: str) -> list[float]:
    return [float(part) for part in value.strip("[]").split(",") if part.strip()]


def parser() -> argparse.ArgumentParser:
    """The options, named as in ``ompmoe fit`` (``--data.*`` as the data module's), defaults as configs/tiny.yaml."""
    p = argparse.ArgumentParser(
        prog="python -m ompmoe.lightning.fabric_prune",
        description="Calibrate and prune an MoE model with Lightning Fabric (DDP or FSDP2), as `ompmoe fit` does.",
    )
    flag: dict[str, Any] = {"type": _bool, "nargs": "?", "const": True, "metavar": "{true,false}"}
    p.add_argument("--path", action="store_true", help="print this script's path (for `fabric run PATH`) and exit")
    model = p.add_argument_group("model")
    model.add_argument("--model", default="shipped:tiny-moe", help="hub id, path, tiny:<model_type> or shipped:<name>")
    model.add_argument("--dtype", default=None, help="weights dtype when loading (bfloat16, float32, ...)")
    model.add_argument("--trust_remote_code", default=False, **flag)
    data = p.add_argument_group("data (ompmoe.CalibrationDataModule)")
    data.add_argument("--data.source", dest="source", default="shipped:mix")
    data.add_argument("--data.tokenizer", dest="tokenizer", default=None, help="default: the model's")
    data.add_argument("--data.seq_len", dest="seq_len", type=int, default=256)
    data.add_argument("--data.num_blocks", dest="num_blocks", type=int, default=16)
    data.add_argument("--data.batch_size", dest="batch_size", type=int, default=4)
    data.add_argument("--data.data_files", dest="data_files", nargs="*", default=None)
    data.add_argument("--data.text_field", dest="text_field", default=None)
    data.add_argument("--data.split", dest="split", default="train")
    data.add_argument("--data.seed", dest="data_seed", type=int, default=None)
    pruning = p.add_argument_group("pruning (ompmoe.PruningStrategy, ExpertPruning)")
    pruning.add_argument("--ratio", type=float, default=0.5)
    pruning.add_argument("--method", default="auto",
                         help="auto: the candidate setting whose pruned model has the lowest loss on --choice_blocks")
    pruning.add_argument("--allocation", default="auto")
    pruning.add_argument("--choice_blocks", type=int, default=None,
                         help="calibration blocks after --data.num_blocks that auto tries its candidates on "
                              "(default: 2048 tokens' worth; 0: none, auto takes the architecture's setting)")
    pruning.add_argument("--risk_weight", type=float, default=3.0)
    pruning.add_argument("--min_kept_fraction", type=float, default=0.375)
    pruning.add_argument("--max_kept_fraction", type=float, default=0.875)
    pruning.add_argument("--loss_aware", default=False, **flag)
    pruning.add_argument("--reroute", default=False, **flag)
    pruning.add_argument("--extra_ratios", type=_ratios, default=None, help="e.g. [0.25,0.75]")
    pruning.add_argument("--adaptive_epsilon", type=float, default=None)
    pruning.add_argument("--output_dir", default="outputs/tiny")
    pruning.add_argument("--overwrite", default=False, **flag)
    pruning.add_argument("--save_model", default=True, **flag)
    pruning.add_argument("--plots", default=True, **flag)
    pruning.add_argument("--save_dtype", default=None, help="weights dtype of the saved model (default: the source's)")
    run = p.add_argument_group("fabric (fabric run sets these itself)")
    run.add_argument("--accelerator", default=None, help="cpu, cuda, gpu, mps, auto")
    run.add_argument("--devices", default=None, help="processes per node, e.g. 2")
    run.add_argument("--num_nodes", type=int, default=None)
    run.add_argument("--strategy", default=None, choices=STRATEGIES, help="fsdp: FSDP2 per decoder layer")
    run.add_argument("--precision", default=None, choices=PRECISIONS)
    run.add_argument("--seed_everything", type=int, default=0)
    return p


def _fabric_strategy(name: str | None, devices: str | None, num_nodes: int | None) -> Any:
    """The Fabric strategy: ``fsdp`` becomes FSDP2 per decoder layer (``ModelParallelStrategy``), others stay names.

    Under ``fabric run --strategy fsdp`` the CLI's choice arrives as ``LT_STRATEGY``; it is taken
    over here (Fabric would refuse a strategy object that differs from the CLI's name).
    """
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
    args = parser().parse_args(argv)
    if args.path:
        print(os.path.abspath(__file__))
        return None
    from lightning.fabric import Fabric

    from ..engine.io import inputs_of, local_inputs
    from ..engine.strategy import PruningStrategy
    from .calibration_data import CalibrationDataModule
    from .fabric import FabricCalibration, check_output
    from .models import default_tokenizer, load_model, resolve_dtype
    from .pruning_steps import choice_data

    strategy = PruningStrategy(ratio=args.ratio, method=args.method, allocation=args.allocation,
                               risk_weight=args.risk_weight, min_kept_fraction=args.min_kept_fraction,
                               max_kept_fraction=args.max_kept_fraction)
    dtype = resolve_dtype(args.dtype)
    tokenizer = default_tokenizer(args.model, args.tokenizer)
    datamodule = CalibrationDataModule(  # checks the source now, reads nothing yet
        args.source, tokenizer=tokenizer, seq_len=args.seq_len, num_blocks=args.num_blocks,
        batch_size=args.batch_size, data_files=args.data_files, text_field=args.text_field, split=args.split,
        seed=args.data_seed,
    )
    options = {key: value for key, value in (("accelerator", args.accelerator), ("devices", args.devices),
                                             ("num_nodes", args.num_nodes), ("precision", args.precision))
               if value is not None}
    fabric = Fabric(strategy=_fabric_strategy(args.strategy, args.devices, args.num_nodes), **options)
    if os.environ.get("LT_CLI_USED") != "1":  # fabric run has started the processes already
        fabric.launch()
    fabric.seed_everything(args.seed_everything)
    inputs = inputs_of(datamodule) + local_inputs(args.model)
    check_output(fabric, args.output_dir, args.overwrite, inputs)  # before loading anything
    model = load_model(args.model, dtype, args.trust_remote_code).eval()
    model = fabric.setup(model)
    calibration = FabricCalibration(
        fabric, model, strategy, output_dir=args.output_dir, overwrite=args.overwrite, save_model=args.save_model,
        extra_ratios=args.extra_ratios, plots=args.plots, adaptive_epsilon=args.adaptive_epsilon,
        tokenizer=tokenizer, dtype=args.save_dtype, loss_aware=args.loss_aware, reroute=args.reroute,
        model_id=args.model, sources=[datamodule.describe()], inputs=inputs,
    )
    datamodule.prepare_data()
    datamodule.setup("fit")
    choice = choice_data(strategy, datamodule, args.choice_blocks, "fabric_prune", calibration.model_type)
    calibration.run(fabric.setup_dataloaders(datamodule.train_dataloader()))
    calibration.finish(choice_blocks=choice)
    return calibration


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` as a command: a user error is one ``error:`` line (from the first rank) and exit status 2."""
    from ..cli import USER_ERRORS

    try:
        main(argv)
    except USER_ERRORS as error:
        if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    if __package__:
        cli()
    else:  # run as a file: import it as the package module, so its relative imports resolve
        from ompmoe.lightning.fabric_prune import cli as package_cli

        package_cli()
