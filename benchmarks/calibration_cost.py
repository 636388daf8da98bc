"""Calibration cost: time and peak memory of each statistics pass relative to a plain forward, in one run.

    python benchmarks/calibration_cost.py --model shipped:tiny-moe-64            # about 3 minutes, 1 thread
    python benchmarks/calibration_cost.py --model shipped:tiny-moe --output docs/quality/timing.json

On the same calibration batches (``--calib_blocks`` blocks of ``--seq_len`` tokens of the shipped
``--calibration`` set, batches of 8, the model in float32 with ``eager`` experts, as
``benchmarks/quality.py`` uses them), five passes:

- ``forward``: a plain forward (``torch.no_grad``);
- ``forward_backward``: a forward plus the backward of the summed next-token loss to the input
  embeddings, weights frozen (what any gradient-based calibration costs at least);
- ``stats``: ``ompmoe.collect_stats``; ``loss_stats``: with ``loss_aware=True``;
  ``reroute_stats``: with ``reroute=True``;
- ``auto_choice`` (layouts where ``method="auto"`` tries several settings: softmax routers): what ``auto`` adds
  after its loss-aware statistics pass: planning each candidate setting and trying each plan on ``--choice_blocks``
  held-out calibration blocks (``ompmoe.choose_plan``, the blocks after the calibration blocks, as
  ``CalibrationDataModule.choice_blocks`` cuts them). ``auto_over_forward_backward`` = (``loss_stats`` +
  ``auto_choice``) / ``forward_backward``.

**Time**: one warm-up round, then ``--repeats`` rounds, each running the five passes in turn
(interleaved, so load from other processes hits all of them alike); medians of wall-clock
(``perf_counter``) and of process CPU time (``process_time``, which another process on the same
cores disturbs less; with one thread it is the work done). Ratios are of medians of this run.

**Peak memory**: each pass once in a fresh process (``python this_file --memory_pass NAME``) that
loads the model and batches, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``: ``5``,
so loading's own peak does not hide the pass's), then reads that mark (``VmHWM`` of ``/proc/self/status``;
``resource.getrusage(RUSAGE_SELF).ru_maxrss`` where there is none) before and after the pass. ``extra`` = peak during the pass minus the resident size before it: the
activations, autograd graph and statistics buffers the pass holds at its worst moment (weights and
batches excluded). Where the mark cannot be reset the difference of the two high-water marks is
reported instead (a lower bound), and ``memory_method`` says so. The children run with
``MALLOC_MMAP_THRESHOLD_=131072`` (glibc), so freed tensors leave the resident set at once and the
peak does not depend on which earlier buffers the allocator kept.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared CPUs: spinning OpenMP threads stall each other
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import ompmoe  # noqa: E402

PASSES = ("forward", "forward_backward", "stats", "loss_stats", "reroute_stats", "auto_choice")
BATCH_SIZE = 8
ROOT = Path(__file__).resolve().parents[1]


def passes(model: torch.nn.Module, blocks: torch.Tensor,
           choice: torch.Tensor | None = None) -> dict[str, Callable[[], Any]]:
    """The passes over ``blocks`` in batches of :data:`BATCH_SIZE`, as zero-argument callables; with ``choice``
    blocks also ``auto_choice`` (its loss-aware statistics are computed here, once, outside every timing)."""

    def forward() -> None:
        with torch.no_grad():
            for batch in blocks.split(BATCH_SIZE):
                model(input_ids=batch, use_cache=False)

    def forward_backward() -> None:
        flags = [p.requires_grad for p in model.parameters()]
        model.requires_grad_(False)
        try:
            for batch in blocks.split(BATCH_SIZE):
                embeds = model.get_input_embeddings()(batch).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten(),
                                                         reduction="sum")
                torch.autograd.grad(loss, embeds)
        finally:
            for p, flag in zip(model.parameters(), flags):
                p.requires_grad_(flag)

    def stats(**options: bool) -> Callable[[], Any]:
        return lambda: ompmoe.collect_stats(model, blocks.split(BATCH_SIZE), progress=False, **options)

    runs = {"forward": forward, "forward_backward": forward_backward, "stats": stats(),
            "loss_stats": stats(loss_aware=True), "reroute_stats": stats(reroute=True)}
    strategy = ompmoe.PruningStrategy(ratio=0.5, method="auto", allocation="auto")
    if choice is not None and len(strategy.settings(model.config.model_type)) > 1:  # a layout where auto tries plans
        computed = ompmoe.collect_stats(model, blocks.split(BATCH_SIZE), progress=False, loss_aware=True)
        runs["auto_choice"] = lambda: ompmoe.choose_plan(model, strategy.candidates(computed), choice, BATCH_SIZE)
    return runs


def time_passes(runs: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds of each pass over ``repeats`` interleaved rounds (after ``warmup`` rounds)."""
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for round_index in range(warmup + repeats):
        for key, fn in runs.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fn()
            if round_index >= warmup:
                wall[key].append(time.perf_counter() - start_wall)
                cpu[key].append(time.process_time() - start_cpu)
    return {"wall": {k: median(v) for k, v in wall.items()}, "cpu": {k: median(v) for k, v in cpu.items()}}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def _max_rss_mib() -> float:
    """The process's peak resident size: ``VmHWM`` (reset by :func:`_reset_peak_rss`), else ``ru_maxrss``.

    ``ru_maxrss`` is the larger of that mark and the marks recorded when threads exited, so a
    loader thread that ended after the loading peak pins it there; ``VmHWM`` is the mark alone.
    """
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def measure_peak_memory(run: Callable[[], Any]) -> dict[str, Any]:
    """Peak RSS (MiB) of ``run()`` above the resident size before it (see the module docstring)."""
    import gc

    gc.collect()
    reset = _reset_peak_rss()
    before = _max_rss_mib()
    run()
    peak = _max_rss_mib()
    return {"before_mib": before, "peak_mib": peak, "extra_mib": peak - before,
            "memory_method": "peak RSS mark (VmHWM) reset before the pass" if reset else
            "difference of peak RSS marks (the mark could not be reset: lower bound)"}


def memory_in_subprocesses(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """:func:`measure_peak_memory` of every pass, each in a fresh interpreter."""
    results = {}
    for name in PASSES:
        command = [sys.executable, str(Path(__file__).resolve()), "--memory_pass", name, "--model", args.model,
                   "--calibration", args.calibration, "--calib_blocks", str(args.calib_blocks),
                   "--seq_len", str(args.seq_len), "--threads", str(args.threads),
                   *(["--choice_blocks", str(args.choice_blocks)] if args.choice_blocks is not None else [])]
        # A fixed mmap threshold: glibc then maps every large buffer on its own and unmaps it when freed, so the
        # resident size follows the live tensors instead of what the allocator's history happened to keep.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072")}
        done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"memory pass {name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if result is not None:
            results[name] = result
    return results


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (float32, eager experts, eval mode), the calibration blocks (as ``benchmarks/quality.py``) and
    the choice blocks after them."""
    from transformers import AutoModelForCausalLM

    from ompmoe.data import shipped_model_path
    from ompmoe.lightning.calibration_data import CalibrationDataModule

    path = shipped_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    data = CalibrationDataModule(f"shipped:{args.calibration}", tokenizer=str(path), seq_len=args.seq_len,
                                 num_blocks=args.calib_blocks)
    return model, data.blocks, data.choice_blocks(args.choice_blocks)


def cost_report(times: dict[str, dict[str, float]], memory: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The JSON written by this benchmark (and ``benchmarks/quality.py``): seconds, ratios, memory."""
    wall, cpu = times["wall"], times["cpu"]
    report: dict[str, Any] = {
        **{f"seconds_{k}": round(v, 4) for k, v in wall.items()},
        **{f"cpu_seconds_{k}": round(v, 4) for k, v in cpu.items()},
        "loss_stats_over_forward_backward": wall["loss_stats"] / wall["forward_backward"],
        "stats_over_forward": wall["stats"] / wall["forward"],
        "loss_stats_over_stats": wall["loss_stats"] / wall["stats"],
        "reroute_stats_over_stats": wall["reroute_stats"] / wall["stats"],
        **({"auto_over_forward_backward": (wall["loss_stats"] + wall["auto_choice"]) / wall["forward_backward"],
            "cpu_auto_over_forward_backward": (cpu["loss_stats"] + cpu["auto_choice"]) / cpu["forward_backward"]}
           if "auto_choice" in wall else {}),
        "cpu_loss_stats_over_forward_backward": cpu["loss_stats"] / cpu["forward_backward"],
        "cpu_stats_over_forward": cpu["stats"] / cpu["forward"],
        "cpu_loss_stats_over_stats": cpu["loss_stats"] / cpu["stats"],
        "cpu_reroute_stats_over_stats": cpu["reroute_stats"] / cpu["stats"],
        "time_over_forward": {k: wall[k] / wall["forward"] for k in wall},
        "cpu_time_over_forward": {k: cpu[k] / cpu["forward"] for k in cpu},
    }
    if memory is not None:
        report.update(memory_report(memory))
    return report


def memory_report(memory: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Peak extra MiB of each pass, its ratio to the plain forward's, the loaded size and the method."""
    base = max(memory["forward"]["extra_mib"], 1e-9)
    return {"peak_extra_mib": {k: round(v["extra_mib"], 1) for k, v in memory.items()},
            "memory_over_forward": {k: v["extra_mib"] / base for k, v in memory.items()},
            "loaded_mib": round(memory["forward"]["before_mib"], 1),
            "memory_method": memory["forward"]["memory_method"] + ", MALLOC_MMAP_THRESHOLD_="
            + os.environ.get("MALLOC_MMAP_THRESHOLD_", "131072")}


def summary_line(report: dict[str, Any]) -> str:
    parts = [f"{k}: {report[f'seconds_{k}']:.2f} s wall ({report['time_over_forward'][k]:.2f}x), "
             f"{report[f'cpu_seconds_{k}']:.2f} s cpu ({report['cpu_time_over_forward'][k]:.2f}x)"
             + (f", peak +{report['peak_extra_mib'][k]:.0f} MiB ({report['memory_over_forward'][k]:.2f}x)"
                if "peak_extra_mib" in report else "") for k in PASSES if f"seconds_{k}" in report]
    return ("\n".join(parts) + f"\nloss-aware stats / (forward + backward): {report['loss_stats_over_forward_backward']:.3f} wall, "
            f"{report['cpu_loss_stats_over_forward_backward']:.3f} cpu; stats / forward: {report['stats_over_forward']:.3f} "
            f"wall, {report['cpu_stats_over_forward']:.3f} cpu" + (
                f"; auto (loss-aware stats + choice) / (forward + backward): {report['auto_over_forward_backward']:.3f} "
                f"wall, {report['cpu_auto_over_forward_backward']:.3f} cpu" if "auto_over_forward_backward" in report else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Calibration cost of each statistics pass (see the module docstring).")
    parser.add_argument("--model", default="shipped:tiny-moe")
    parser.add_argument("--calibration", default="mix", help="shipped calibration set: prose, code or mix")
    parser.add_argument("--calib_blocks", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--choice_blocks", type=int, default=None,
                        help="held-out calibration blocks auto tries plans on (default: 2048 tokens' worth, as auto)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no_memory", action="store_true", help="time only (no fresh process per pass)")
    parser.add_argument("--no_time", action="store_true", help="peak memory only (no timing rounds)")
    parser.add_argument("--output", default=None, help="write the JSON here (atomically)")
    parser.add_argument("--memory_pass", choices=PASSES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1; got {args.repeats}.")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, blocks, choice = load(args)
    if args.memory_pass is not None:  # child process: one pass, one JSON line
        run = passes(model, blocks, choice if args.memory_pass == "auto_choice" else None).get(args.memory_pass)
        if run is None:  # auto_choice on a layout where auto tries nothing
            print(json.dumps(None))
            return {}
        print(json.dumps(measure_peak_memory(run)))
        return {}
    if args.no_time and args.no_memory:
        parser.error("--no_time and --no_memory leave nothing to measure; drop one of them.")
    memory = None if args.no_memory else memory_in_subprocesses(args)
    report = {"model": args.model, "calibration": args.calibration, "tokens": int(blocks.numel()),
              "batch_size": BATCH_SIZE, "threads": args.threads, "torch": torch.__version__}
    if args.no_time:
        report.update(memory_report(memory))
        print(json.dumps(report, indent=1), flush=True)
    else:
        report.update(repeats=args.repeats, **cost_report(time_passes(passes(model, blocks, choice), args.repeats), memory))
        print(f"{args.model}, {args.calib_blocks} x {args.seq_len} tokens ({args.calibration}), {args.threads} "
              f"thread(s), medians of {args.repeats} interleaved rounds:\n" + summary_line(report), flush=True)
    if args.output:
        from ompmoe.engine.io import atomic_path

        with atomic_path(Path(args.output), overwrite=True) as tmp:
            tmp.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
