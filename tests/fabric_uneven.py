"""Two Fabric ranks that see different numbers of batches (launched as a script by tests/lightning/test_fabric.py).

usage: python tests/fabric_uneven.py OUTPUT_DIR {ddp,fsdp}

Rank 0 takes the first ``RANK0_BATCHES`` of :func:`uneven_batches`, rank 1 the other two; there is no
DistributedSampler. ``ddp`` calls ``FabricCalibration.update`` per batch, ``fsdp`` (FSDP2) calls ``run`` on the
rank's list, which keeps the rank with fewer batches in the weight all-gathers.
"""

import sys

import torch
from lightning.fabric import Fabric

from ompmoe import PruningStrategy
from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe.engine.tiny import tiny_model

RANK0_BATCHES = 3


def uneven_batches() -> list:
    """Five batches: input-id tensors, and dicts whose masks pad some positions."""
    blocks = token_blocks(byte_tokens(shipped_text()), 24, 7)
    padded = {"input_ids": blocks[3:5], "attention_mask": torch.ones_like(blocks[3:5])}
    padded["attention_mask"][1, 17:] = 0
    return [blocks[0:1], {"input_ids": blocks[1:3], "attention_mask": torch.ones_like(blocks[1:3])}, padded,
            blocks[5:6], {"input_ids": blocks[6:7], "attention_mask": torch.ones_like(blocks[6:7])}]


def main(output_dir: str, mode: str) -> None:
    from ompmoe.lightning.fabric import FabricCalibration, fsdp2

    torch.set_num_threads(1)
    if mode == "ddp":
        strategy = "ddp"
    else:
        from lightning.fabric.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(parallelize_fn=fsdp2, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(tiny_model("qwen3_moe"))
    calibration = FabricCalibration(fabric, model, PruningStrategy(ratio=0.5, min_kept_fraction=0.25),
                                    output_dir=output_dir, plots=False, loss_aware=True)
    batches = uneven_batches()
    mine = batches[:RANK0_BATCHES] if fabric.global_rank == 0 else batches[RANK0_BATCHES:]
    if mode == "ddp":
        for batch in mine:
            calibration.update(batch)
    else:
        calibration.run(mine)
    calibration.finish()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
