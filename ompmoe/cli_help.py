"""Help texts of the ``ompmoe`` command: the command list and the short ``ompmoe fit -h``.

LightningCLI's own top-level help lists only its Trainer subcommands and its ``fit --help``
runs to a thousand lines; a newcomer needs every command on one screen and the handful of
options of a calibration fit. ``tests/test_cli.py`` checks that every option named here exists.
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
    ("--trainer.callbacks.help ExpertPruning", "all options of the pruning callback (output_dir, strategy, ...)"),
]

FIT_SHORT_HELP = (
    "usage: ompmoe fit -c CONFIG [options]\n\n"
    "Calibrate a Mixture-of-Experts model on text and prune it with the ExpertPruning callback\n"
    "named in the config (statistics, plan, plots and the pruned model go to its output_dir).\n\n"
    "common options:\n"
    + "".join(f"  {option:<40} {text}\n" for option, text in FIT_OPTIONS)
    + "\nThe ratio, method and output_dir are set in the config's callback section (see configs/tiny.yaml).\n"
    "All options (about a thousand, Lightning's Trainer included):\n"
    "  ompmoe fit --help\n"
)


__all__ = ["COMMANDS", "FIT_OPTIONS", "FIT_SHORT_HELP", "TOP_HELP"]
