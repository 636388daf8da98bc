"""Streamed per-layer statistics: everything selection and allocation need, as exact sums.

Because the layer signal is ``Y = sum_e V_e``, the greedy pursuit only ever needs inner
products of atoms, so each layer keeps an ``N_e x N_e`` float64 Gram matrix instead of the
atoms themselves, plus a few per-expert sums. Sums merge exactly across batches, ranks and
processes, which is what makes one statistics file serve every pruning ratio.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .io import atomic_path

PER_EXPERT_SUMS = ("routing_mass", "token_count", "sq_norm_sum", "norm_sum", "weighted_norm_sum")
OPTIONAL_TENSORS = ("gram_normalized",)
"""Tensors that statistics files written by older versions may lack (``None`` when absent)."""
ROUTING_KEYS = ("num_experts", "top_k", "num_groups", "topk_group", "group_score_topk")
FORMAT_VERSION = 1


class FingerprintMismatchError(ValueError):
    """Statistics or a plan were made on a model with a different MoE structure."""


@dataclass
class LayerStats:
    """Sums over calibration tokens for one MoE layer (weights are native top-k router weights ``g``).

    ``gram[e, f] = sum_x <g_e F_e(x), g_f F_f(x)>`` over tokens routed to both ``e`` and ``f``.
    """

    name: str
    num_experts: int
    top_k: int
    num_groups: int
    topk_group: int
    group_score_topk: int
    gram: torch.Tensor
    routing_mass: torch.Tensor
    """Sum of the native top-k weight ``g_e(x)`` over routed tokens."""
    token_count: torch.Tensor
    """Number of routed tokens per expert."""
    sq_norm_sum: torch.Tensor
    """Sum of ``||F_e(x)||^2`` over routed tokens (the unweighted expert output)."""
    norm_sum: torch.Tensor
    """Sum of ``||F_e(x)||`` over routed tokens (EAN baseline)."""
    weighted_norm_sum: torch.Tensor
    """Sum of ``g_e(x) ||F_e(x)||`` over routed tokens (REAP baseline)."""
    gram_normalized: torch.Tensor | None = None
    """Token-normalized Gram ``sum_x <V_e(x), V_f(x)> / ||Y_x||^2`` (``Y_x = sum_e V_e(x)``, the
    token's routed output; tokens whose atoms cancel to ``||Y_x||^2 <= 1e-6 sum_e ||V_e(x)||^2``
    are left out), the objective of the ``omp_normalized`` baseline. ``None`` for statistics
    written before it was collected."""

    @property
    def alpha(self) -> torch.Tensor:
        """Energy coefficient ``alpha_e = E||F_e(x)||^2`` over the tokens routed to ``e``."""
        return self.sq_norm_sum / self.token_count.clamp(min=1.0)

    @property
    def signal_energy(self) -> float:
        """``||Y||^2`` of the routed output, since ``Y = sum_e V_e``."""
        return float(self.gram.sum())

    @property
    def atom_energy(self) -> torch.Tensor:
        """``||V_e||^2`` per expert (the Gram diagonal)."""
        return self.gram.diagonal()

    @property
    def routing(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in ROUTING_KEYS}

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = {"gram": self.gram, **{key: getattr(self, key) for key in PER_EXPERT_SUMS}}
        tensors.update({key: getattr(self, key) for key in OPTIONAL_TENSORS if getattr(self, key) is not None})
        return tensors

    def merge(self, other: LayerStats) -> LayerStats:
        """Exact sum; an optional tensor survives only if both sides have it."""
        if (self.name, self.routing) != (other.name, other.routing):
            raise ValueError(f"Cannot merge statistics of different layers: {self.name!r} vs {other.name!r}.")
        mine, theirs = self.tensors(), other.tensors()
        summed = {key: value + theirs[key] for key, value in mine.items() if key in theirs}
        return LayerStats(name=self.name, **self.routing, **summed)


@dataclass
class MoEStats:
    """Statistics of every MoE layer of one model, plus where they came from."""

    layers: list[LayerStats]
    num_tokens: int
    fingerprint: str
    model_id: str | None = None
    model_type: str | None = None
    sources: list[str] = field(default_factory=list)
    library_version: str = ""

    def __post_init__(self) -> None:
        if not self.library_version:
            from . import __version__

            self.library_version = __version__

    def layer(self, name: str) -> LayerStats:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"No MoE layer named {name!r}; layers: {[layer.name for layer in self.layers]}")

    # ------------------------------------------------------------------ merging
    def merge(self, other: MoEStats) -> MoEStats:
        """Exact sum of two partial statistics of the same model (other batches, ranks or runs)."""
        if self.fingerprint != other.fingerprint:
            raise FingerprintMismatchError(
                f"Cannot merge statistics of different models (fingerprints {self.fingerprint} and "
                f"{other.fingerprint}). Collect both on the same model."
            )
        return MoEStats(
            layers=[a.merge(b) for a, b in zip(self.layers, other.layers)],
            num_tokens=self.num_tokens + other.num_tokens,
            fingerprint=self.fingerprint,
            model_id=self.model_id or other.model_id,
            model_type=self.model_type or other.model_type,
            sources=self.sources + [s for s in other.sources if s not in self.sources],
            library_version=self.library_version,
        )

    # ------------------------------------------------------------- compatibility
    def check_compatible(self, model: torch.nn.Module) -> None:
        """Refuse a model whose MoE structure differs from the one the statistics were taken on."""
        actual = model_fingerprint(model)
        if actual != self.fingerprint:
            raise FingerprintMismatchError(
                f"These statistics were collected on a different model (fingerprint {self.fingerprint}, "
                f"model_id={self.model_id!r}); this model has fingerprint {actual}. "
                "Re-run collect_stats on this model, or load the model the statistics came from."
            )

    # ------------------------------------------------------------------ on disk
    def metadata(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "library_version": self.library_version,
            "fingerprint": self.fingerprint,
            "model_id": self.model_id,
            "model_type": self.model_type,
            "num_tokens": self.num_tokens,
            "sources": self.sources,
            "layers": [{"name": layer.name, **layer.routing} for layer in self.layers],
        }

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write one ``.safetensors`` file whose header holds the JSON metadata."""
        tensors = {
            f"layers.{i}.{key}": value.detach().to("cpu", torch.float64).contiguous()
            for i, layer in enumerate(self.layers)
            for key, value in layer.tensors().items()
        }
        with atomic_path(path, overwrite=overwrite) as tmp:
            save_file(tensors, str(tmp), metadata={"ompmoe": json.dumps(self.metadata())})
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module | None = None) -> MoEStats:
        """Read statistics; with ``model``, refuse them if its fingerprint differs."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No statistics file at {path}; create one with ompmoe.collect_stats(...).save(path).")
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            header = (handle.metadata() or {}).get("ompmoe")
        if header is None:
            raise ValueError(f"{path} is a safetensors file but not ompmoe statistics (no 'ompmoe' metadata).")
        meta = json.loads(header)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} has statistics format {meta.get('format_version')}, expected {FORMAT_VERSION}.")
        tensors = load_file(str(path))
        layers = [
            LayerStats(
                name=info["name"],
                **{key: info[key] for key in ROUTING_KEYS},
                gram=tensors[f"layers.{i}.gram"],
                **{key: tensors[f"layers.{i}.{key}"] for key in PER_EXPERT_SUMS},
                **{key: tensors.get(f"layers.{i}.{key}") for key in OPTIONAL_TENSORS},
            )
            for i, info in enumerate(meta["layers"])
        ]
        stats = cls(
            layers=layers,
            num_tokens=int(meta["num_tokens"]),
            fingerprint=meta["fingerprint"],
            model_id=meta.get("model_id"),
            model_type=meta.get("model_type"),
            sources=list(meta.get("sources", [])),
            library_version=meta.get("library_version", ""),
        )
        if model is not None:
            stats.check_compatible(model)
        return stats


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of what the statistics depend on: architecture, sizes and every MoE layer's routing.

    Dtype, attention or experts implementation and the checkpoint path do not change it.
    """
    from .adapters import find_moe_layers

    config = model.config
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    payload = {
        "config": {key: getattr(config, key, None) for key in keys},
        "layers": [{"name": layer.name, **layer.routing} for layer in find_moe_layers(model)],
    }
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:16]

