"""What the quantized file formats ompmoe reads (:mod:`.block_fp8`, :mod:`.mxfp4`) share: their error, and the
slices that stand for a quantized weight in a :class:`~ompmoe.engine.lazy_checkpoint.LazyCheckpoint` (its values
computed from the stored tensors, or a placeholder the pruned writer never reads)."""

from __future__ import annotations

from typing import Any

import torch


class QuantizedCheckpointError(ValueError):
    """A checkpoint stored in a quantized format ompmoe does not read (or stored inconsistently)."""


class ComputedSlice:
    """A weight of the files whose values are computed, not its stored bytes (what transformers' loading reads from
    a safetensors slice: ``slice[...]``, its shape and dtype); the direct byte reads skip it."""

    def get_shape(self) -> list[int]:
        raise NotImplementedError

    def get_dtype(self) -> str:
        raise NotImplementedError

    def __getitem__(self, index: Any) -> torch.Tensor:
        raise NotImplementedError


class UnreadSlice(ComputedSlice):
    """A quantized weight the pruned writer never reads into the model: a placeholder of its shape, all NaN (what is
    written is the stored tensors, :meth:`~ompmoe.engine.lazy_checkpoint.LazyCheckpoint.as_stored`, which refuses to
    write a placeholder it did not replace), so that the kept experts' bytes are read once, not also dequantized.
    One NaN seen at every position: no memory of its own until it is copied (the pruning's cut to the kept experts'
    rows, a tensor made contiguous to be written, a skeleton in another dtype)."""

    def __init__(self, shape: list[int]) -> None:
        self.shape = list(shape)

    def get_shape(self) -> list[int]:
        return self.shape

    def get_dtype(self) -> str:
        return "BF16"

    def __getitem__(self, index: Any) -> torch.Tensor:
        return torch.full((), float("nan"), dtype=torch.bfloat16).expand(self.shape)[index]


E4M3_FILE_DTYPE = "F8_E4M3"
"""The safetensors dtype of FP8 weights (E4M3, the format of every FP8 release); other 8-bit float dtypes (E5M2,
E8M0) are refused by name."""


def refuse_other_fp8(headers: dict[str, str], fp8: list[str], source: Any, fix: str) -> None:
    """Refuse the files' 8-bit float weights ``fp8`` stored in anything but E4M3 (``fix``: what the format reads)."""
    other = [f"{name} ({headers[name]})" for name in fp8 if headers[name] != E4M3_FILE_DTYPE]
    if other:
        raise QuantizedCheckpointError(
            f"{source} stores {len(other)} weights in an 8-bit float other than E4M3 ({', '.join(other[:2])}"
            f"{', ...' if len(other) > 2 else ''}); {fix}. Prune the full-precision checkpoint instead.")


def refuse_unscaled(source: Any, wrong: list[str]) -> None:
    """Refuse FP8 weights whose scales are missing or do not fit them (``wrong``: each one's reason)."""
    if wrong:
        raise QuantizedCheckpointError(f"{source} stores FP8 weights ompmoe cannot scale: {'; '.join(wrong[:3])}"
                                       f"{'; ...' if len(wrong) > 3 else ''}. Its files are incomplete or in "
                                       "another FP8 layout.")


__all__ = ["ComputedSlice", "QuantizedCheckpointError", "UnreadSlice", "refuse_other_fp8", "refuse_unscaled"]
