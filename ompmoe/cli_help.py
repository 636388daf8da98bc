"""Help texts of the ``ompmoe`` command: every command on one screen, and a one-screen ``-h`` of the Lightning
commands, whose ``--help`` runs to a thousand lines. ``tests/test_cli.py`` checks that every option named here exists.
"""

from __future__ import annotations

COMMANDS = {
    "fit": "calibrate a model on text and prune it (Lightning; `ompmoe fit -h` lists the common options)",
    "prune": "re-plan (and prune) at other ratios from a saved stats.safetensors, without recalibrating",
    "plot": "write heatmaps, residual curves, the allocation and tables from a stats.safetensors",
    "validate": "evaluate a model on an lm-eval suite (Lightning; configs/eval/*.yaml)",
    "test": "like validate, on the suite's test split",
    "predict": "Lightning's predict loop on the calibration module (rarely needed)",
    "report": "Markdown table (the paper's Table 1) from result files of validate/test",
}

TOP_HELP = (
    "usage: ompmoe <command> [options]\n\n"
    "Training-free expert pruning for Mixture-of-Experts LLMs (OMP-MoE).\n\n"
    "commands:\n"
    + "".join(f"  {name:<9} {text}\n" for name, text in COMMANDS.items())
    + "\nRun `ompmoe <command> --help` for a command's options.\n"
    "Start here: ompmoe fit -c configs/tiny.yaml\n"
)

# (option, what it does) of a calibration fit, in the order a newcomer needs them.
FIT_OPTIONS = [
    ("-c, --config CONFIG", "YAML config to start from, e.g. configs/tiny.yaml (later options override it)"),
    ("--print_config", "print the resulting config (YAML) and exit"),
    ("--quiet", "no progress bars, no model summary, no Lightning info lines"),
    ("--model.model MODEL", "hub id, local path, shipped:tiny-moe or tiny:<model_type>"),
    ("--model.dtype DTYPE", "bfloat16, float16 or float32 (default: the checkpoint's)"),
    ("--data.source SOURCE", "wikitext2, c4, shipped:mix, owner/name on the hub, or .txt/.jsonl/.parquet files"),
    ("--data.seq_len N", "tokens per calibration block"),
    ("--data.num_blocks N", "number of calibration blocks"),
    ("--data.batch_size N", "blocks per forward pass"),
    ("--trainer.accelerator ACC", "cpu, gpu, auto, ..."),
    ("--trainer.devices N", "devices (FSDP2 configs use 8)"),
    ("--trainer.callbacks.init_args.strategy.init_args.ratio R",
     "fraction of routed experts to remove, e.g. 0.25 (also .method, .allocation)"),
    ("--trainer.callbacks.init_args.output_dir DIR", "where stats, plan, plots and model/ are written"),
    ("--trainer.callbacks.help ExpertPruning", "all options of the pruning callback (output_dir, strategy, ...)"),
]


def _option_line(option: str, text: str) -> str:
    """One option of the short help; an option too long for the column gets its text on the next line."""
    return f"  {option:<40} {text}\n" if len(option) <= 40 else f"  {option}\n  {'':<40} {text}\n"


FIT_SHORT_HELP = (
    "usage: ompmoe fit -c CONFIG [options]\n\n"
    "Calibrate a Mixture-of-Experts model on text and prune it with the ExpertPruning callback\n"
    "named in the config (statistics, plan, plots and the pruned model go to its output_dir).\n\n"
    "common options:\n"
    + "".join(_option_line(option, text) for option, text in FIT_OPTIONS)
    + "\nThe --trainer.callbacks.init_args.* options set the config's last callback (ExpertPruning in configs/),\n"
    "e.g. ompmoe fit -c configs/tiny.yaml --trainer.callbacks.init_args.strategy.init_args.ratio 0.25\n"
    "All options (about a thousand, Lightning's Trainer included):\n"
    "  ompmoe fit --help\n"
)


# (option, what it does) of ``ompmoe validate`` / ``test``: the lm-eval suite of configs/eval/*.yaml.
EVAL_OPTIONS = [
    ("-c, --config CONFIG", "YAML config to start from, e.g. configs/eval/tiny.yaml (later options override it)"),
    ("--print_config", "print the resulting config (YAML) and exit"),
    ("--model.model MODEL", "hub id, local path (a pruned model/ too) or shipped:tiny-moe"),
    ("--model.dtype DTYPE", "bfloat16, float16 or float32"),
    ("--model.label LABEL", "the row's name in ompmoe report (null: named after the recorded plan)"),
    ("--model.experts_implementation IMPL", "eager, grouped_mm or batched_mm (transformers' experts kernels)"),
    ("--data.tasks [TASK,...]", "lm-eval task or group names"),
    ("--data.include_path DIR", "a folder of extra lm-eval task YAMLs"),
    ("--data.batch_size N", "requests per forward pass"),
    ("--data.output_path FILE", "results file for ompmoe report"),
    ("--overwrite", "replace an existing results file (refused otherwise)"),
]

EVAL_SHORT_HELP = (
    "usage: ompmoe {command} -c CONFIG [options]\n\n"
    "Evaluate a model on an lm-eval suite through Lightning ({split}); the results file feeds ompmoe report.\n\n"
    "common options:\n"
    + "".join(_option_line(option, text) for option, text in EVAL_OPTIONS)
    + "\nAll options (Lightning's Trainer included):\n"
    "  ompmoe {command} --help\n"
)

PREDICT_SHORT_HELP = (
    "usage: ompmoe predict -c CONFIG [options]\n\n"
    "Lightning's predict loop on the calibration module (rarely needed; ompmoe fit calibrates and prunes).\n"
    "It takes the options of ompmoe fit (see ompmoe fit -h). All options:\n"
    "  ompmoe predict --help\n"
)


def short_help(command: str) -> str | None:
    """The one-screen ``-h`` of ``command``, or ``None`` where ``-h`` is the command's own full help."""
    if command in ("validate", "test"):
        split = "validation" if command == "validate" else "test"
        return EVAL_SHORT_HELP.format(command=command, split=f"the suite's {split} split")
    return {"fit": FIT_SHORT_HELP, "predict": PREDICT_SHORT_HELP}.get(command)


def unknown_command(command: str) -> str:
    """The error for a command ompmoe lacks: the closest name, then every command."""
    import difflib

    close = difflib.get_close_matches(command, COMMANDS, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown command {command!r}: {hint}the commands are {', '.join(COMMANDS)} (see ompmoe --help)"


def with_registry_names(doc: str) -> str:
    """``doc`` with METHOD_NAMES, ALLOCATION_NAMES and METHOD_OPTIONS spelled out from the registries (it imports
    them, and torch: ``ompmoe prune --help`` is built once and then printed from the help cache)."""
    from .engine.methods import METHODS, option_defaults  # first: importing the methods registers their allocations
    from .engine.planning.allocation import ALLOCATIONS

    options = "; ".join(f"{name}: {', '.join(f'{key}={value!r}' for key, value in option_defaults(name).items())}"
                        for name in METHODS if option_defaults(name))
    auto = "auto (the setting recommended for the model's architecture), "
    methods = auto + ", ".join(METHODS) + " or one registered with ompmoe.register_method"
    return (doc.replace("METHOD_NAMES", methods).replace("ALLOCATION_NAMES", auto + ", ".join(ALLOCATIONS))
            .replace("METHOD_OPTIONS", options))


__all__ = ["COMMANDS", "EVAL_OPTIONS", "FIT_OPTIONS", "FIT_SHORT_HELP",
           "TOP_HELP", "short_help", "unknown_command", "with_registry_names"]
