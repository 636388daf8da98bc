"""The save step: stock ``save_pretrained`` against ``save_pretrained`` with ompmoe's parallel safetensors writer.

    python benchmarks/save_speed.py                            # CPU, 4 Qwen3-30B-A3B layers (4.6 GB), /dev/shm
    python benchmarks/save_speed.py --device cuda --layers 24  # 30 GB on a GPU: the pruned Qwen3-30B-A3B's size
    python benchmarks/save_speed.py --small                    # smoke test of the script (seconds)

One model of the Qwen3-30B-A3B shape (bf16, random weights) is saved, interleaved, ``--repeats`` times each way:

``stock``     ``model.save_pretrained`` as transformers ships it (``safetensors.torch.save_file``: one thread, GPU
              tensors copied to pageable memory one at a time);
``parallel``  the same call inside :func:`~ompmoe.engine.export.safetensors_writer.parallel_pretrained_writes` (what
              ``ompmoe.save_pruned`` runs): the same files, checked equal byte for byte;
``floor``     :func:`~ompmoe.engine.export.safetensors_writer.write_safetensors` of the same bytes in one call, without
              ``save_pretrained``'s own work (reverting the fused experts to the files' per-expert names).

Medians and the ratios stock / parallel and parallel / floor are printed and written as JSON (``--out``). Torch runs
one thread on the CPU so the machine's other work moves the ratios less; the writer's threads are
``--threads`` (default: one per core up to 8).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import QWEN3_30B_A3B, build_model  # noqa: E402

from ompmoe._quiet import quiet_calls  # noqa: E402
from ompmoe.engine.export.safetensors_writer import (default_threads, parallel_pretrained_writes,  # noqa: E402
                                                     write_safetensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the copies are written (each removed after it is timed)")
    parser.add_argument("--small", action="store_true", help="a 2-layer model a tenth of the width")
    parser.add_argument("--out", default=None, help="a JSON file for the figures")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    shape = dict(QWEN3_30B_A3B, hidden_size=256, moe_intermediate_size=96, intermediate_size=512,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64) if args.small else QWEN3_30B_A3B
    model = build_model(shape, num_layers=2 if args.small else args.layers, vocab_size=None, dtype=torch.bfloat16,
                        device=device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    threads = args.threads or default_threads()
    fused = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    root = Path(tempfile.mkdtemp(prefix="ompmoe-save-", dir=args.dir))
    print(f"{model_bytes / 2**30:.2f} GiB on {device}, {threads} writer threads, into {root}", flush=True)

    def synchronized(fn):
        def run() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started
        return run

    def stock() -> None:
        with quiet_calls():
            model.save_pretrained(root / "stock")

    def parallel() -> None:
        with quiet_calls(), parallel_pretrained_writes():
            model.save_pretrained(root / "parallel")

    def floor() -> None:
        (root / "floor").mkdir()
        write_safetensors(fused, root / "floor" / "model.safetensors", {"format": "pt"}, threads=threads)

    ways = {"stock": stock, "parallel": parallel, "floor": floor}
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for repeat in range(args.repeats):
            for name, fn in ways.items():
                times[name].append(synchronized(fn)())
                if repeat == 0 and name == "parallel":  # stock's copy is kept until this comparison
                    same = all(filecmp.cmp(root / "stock" / file.name, file, shallow=False)
                               for file in (root / "parallel").iterdir())
                    print(f"parallel files equal to stock byte for byte: {same}", flush=True)
                    if not same:
                        raise SystemExit("the parallel writer's files differ from save_pretrained's")
                if repeat > 0 or name != "stock":  # at most two copies on the disk at once
                    shutil.rmtree(root / name)
                    shutil.rmtree(root / "stock", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch": torch.__version__, "model_gib": model_bytes / 2**30, "threads": threads, "repeats": args.repeats,
        "median_s": medians, "gib_per_s": {name: model_bytes / 2**30 / value for name, value in medians.items()},
        "stock_over_parallel": medians["stock"] / medians["parallel"],
        "parallel_over_floor": medians["parallel"] / medians["floor"],
    }
    for name, value in medians.items():
        print(f"{name:9s} {value:7.3f} s  ({result['gib_per_s'][name]:.2f} GiB/s)")
    print(f"stock / parallel {result['stock_over_parallel']:.2f}x; parallel / floor {result['parallel_over_floor']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
