"""Streamed per-layer statistics: everything selection and allocation need, as exact sums.

Since ``Y = sum_e V_e``, the pursuit needs only inner products of atoms: each layer keeps an ``N_e x N_e``
float64 Gram plus per-expert sums, which merge exactly across batches, ranks and runs (one file serves every ratio).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..adapters import ROUTING_KEYS, find_moe_layers
from ..model_classes import text_config
from ..io import atomic_path
from ..safetensors_header import CorruptSafetensorsError, read_header
from .extensions import STATISTICS, extension_providing
from .input_kinds import check_input_kind

PER_EXPERT_SUMS = ("routing_mass", "token_count", "sq_norm_sum", "norm_sum", "weighted_norm_sum")
CORE_OPTIONAL_TENSORS = ("gram_normalized",)
"""Core sums that statistics files written by older versions may lack (``None`` when absent)."""
FORMAT_VERSION = 2
"""2: the fingerprint covers every shape the statistics depend on."""
SYMMETRY_TOLERANCE = 1e-6


def optional_tensors() -> tuple[str, ...]:
    """Tensors a statistics file may lack: the newer core sums and every registered extension's."""
    extension_tensors = (key for cls in STATISTICS.values() for key in cls.tensors)
    return tuple(dict.fromkeys([*CORE_OPTIONAL_TENSORS, *extension_tensors]))


class FingerprintMismatchError(ValueError):
    """Statistics or a plan were made on a model with a different MoE structure."""


class StatsFileError(ValueError):
    """A statistics file is corrupt or inconsistent with its own metadata; re-collect it."""


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
    """Token-normalized Gram ``sum_x <V_e(x), V_f(x)> / ||Y_x||^2`` (tokens whose atoms cancel left out), the
    ``omp_normalized`` objective; ``None`` in older statistics."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sums of statistics extensions (``gram_loss``, ``gram_reroute``...): read them as attributes, ``None`` when
    these statistics lack them."""

    def __getattr__(self, key: str) -> Any:
        """An extension's tensor without a field: from ``extra``, ``None`` when these statistics lack it."""
        if key.startswith("__") or key == "extra":
            raise AttributeError(key)
        if extension_providing(key) is None and key not in self.__dict__.get("extra", {}):
            raise AttributeError(f"{type(self).__name__} has no attribute {key!r}")
        return self.__dict__.get("extra", {}).get(key)

    @classmethod
    def from_tensors(cls, name: str, routing: dict[str, int], tensors: dict[str, torch.Tensor]) -> LayerStats:
        """A layer from its named tensors (as :meth:`tensors` returns them); unknown names go to ``extra``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {key: value for key, value in tensors.items() if key in fields}
        extra = {key: value for key, value in tensors.items() if key not in fields}
        return cls(name=name, **routing, **known, extra=extra)  # type: ignore[arg-type]

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> LayerStats:
        """This layer with ``tensors`` added or replaced."""
        return LayerStats.from_tensors(self.name, self.routing, {**self.tensors(), **tensors})

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
        normalized = {"gram_normalized": self.gram_normalized} if self.gram_normalized is not None else {}
        return {"gram": self.gram, **{key: getattr(self, key) for key in PER_EXPERT_SUMS}, **normalized, **self.extra}

    def merge(self, other: LayerStats) -> LayerStats:
        """Exact sum; an optional tensor survives only if both sides have it."""
        if (self.name, self.routing) != (other.name, other.routing):
            raise ValueError(f"Cannot merge statistics of different layers: {self.name!r} vs {other.name!r}.")
        mine, theirs = self.tensors(), other.tensors()
        summed = {key: value + theirs[key] for key, value in mine.items() if key in theirs}
        return LayerStats.from_tensors(self.name, self.routing, summed)


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
            from ..version import __version__

            self.library_version = __version__

    def layer(self, name: str) -> LayerStats:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"No MoE layer named {name!r}; layers: {[layer.name for layer in self.layers]}")

    def merge(self, other: MoEStats) -> MoEStats:
        """Exact sum of two partial statistics of the same model (other batches, ranks or runs)."""
        if self.fingerprint != other.fingerprint:
            raise FingerprintMismatchError(
                f"Cannot merge statistics of different models (fingerprints {self.fingerprint} and "
                f"{other.fingerprint}). Collect both on the same model.")
        return MoEStats(
            layers=[a.merge(b) for a, b in zip(self.layers, other.layers)],
            num_tokens=self.num_tokens + other.num_tokens, fingerprint=self.fingerprint,
            model_id=self.model_id or other.model_id, model_type=self.model_type or other.model_type,
            sources=self.sources + [s for s in other.sources if s not in self.sources],
            library_version=self.library_version)

    def check_compatible(self, model: torch.nn.Module) -> None:
        """Refuse a model whose MoE structure differs from the one the statistics were taken on."""
        actual = model_fingerprint(model)
        if actual != self.fingerprint:
            raise FingerprintMismatchError(
                f"These statistics were collected on a different model (fingerprint {self.fingerprint}, "
                f"model_id={self.model_id!r}); this model has fingerprint {actual}. "
                "Re-run collect_stats on this model, or load the model the statistics came from.")

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
        tensors = {f"layers.{i}.{key}": value.detach().to("cpu", torch.float64).contiguous()
                   for i, layer in enumerate(self.layers) for key, value in layer.tensors().items()}
        with atomic_path(path, overwrite=overwrite) as tmp:
            save_file(tensors, str(tmp), metadata={"ompmoe": json.dumps(self.metadata())})
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module | None = None) -> MoEStats:
        """Read statistics; with ``model``, refuse them if its fingerprint differs."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"No statistics file at {path}; a calibration fit writes one (ompmoe fit -c configs/tiny.yaml: "
                f"outputs/tiny/stats.safetensors), as does ompmoe.collect_stats(...).save(path).")
        check_input_kind(path, "statistics")  # a plan or a model's weights given as statistics
        fix = "Re-collect it: ompmoe.collect_stats(model, batches).save(path)."
        try:
            read_header(path)  # sizes, offsets and shapes, before safetensors trusts them
            with safe_open(str(path), framework="pt") as handle:
                header = (handle.metadata() or {}).get("ompmoe")
        except CorruptSafetensorsError as error:
            raise StatsFileError(f"{error}. {fix}") from None
        except Exception as error:  # safetensors' own error types
            raise StatsFileError(f"{path}: not a readable safetensors file ({error}). {fix}") from None
        if header is None:
            raise ValueError(f"{path} is a safetensors file but not ompmoe statistics (no 'ompmoe' metadata).")
        try:
            meta = json.loads(header)
        except json.JSONDecodeError as error:
            raise StatsFileError(f"{path}: the 'ompmoe' metadata is not valid JSON ({error}). {fix}") from None
        if not isinstance(meta, dict):
            raise StatsFileError(f"{path}: the 'ompmoe' metadata is not a JSON object. {fix}")
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise StatsFileError(
                f"{path} has statistics format {version!r} (written by ompmoe {meta.get('library_version') or '?'}); "
                f"this ompmoe reads format {FORMAT_VERSION} only: load it with that version, or "
                f"{fix[0].lower()}{fix[1:]}")
        try:
            tensors = load_file(str(path))
        except Exception as error:  # safetensors raises its own error types for truncated files
            raise StatsFileError(f"{path}: the tensors cannot be read ({error}). {fix}") from None
        layers = _layers_from_file(path, meta, tensors, fix)
        num_tokens = meta.get("num_tokens")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise StatsFileError(f"{path}: num_tokens is {num_tokens!r}; it must be a positive int. {fix}")
        fingerprint = meta.get("fingerprint")
        if not isinstance(fingerprint, str):
            raise StatsFileError(f"{path}: the metadata has no fingerprint. {fix}")
        stats = cls(layers=layers, num_tokens=num_tokens, fingerprint=fingerprint, model_id=meta.get("model_id"),
                    model_type=meta.get("model_type"), sources=list(meta.get("sources", [])),
                    library_version=meta.get("library_version", ""))
        if model is not None:
            stats.check_compatible(model)
        return stats


def _layers_from_file(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor], fix: str
                      ) -> list[LayerStats]:
    """Every layer listed in the metadata, after checking its tensors: present, shaped, float64, finite, sane."""
    infos = meta.get("layers")
    if not isinstance(infos, list) or not infos:
        raise StatsFileError(f"{path}: the metadata lists no layers. {fix}")
    by_layer: list[dict[str, torch.Tensor]] = [{} for _ in infos]
    undescribed = []
    for full_name, tensor in tensors.items():
        layer, _, key = full_name.rpartition(".")
        index = layer.removeprefix("layers.")
        if layer.startswith("layers.") and index.isdigit() and int(index) < len(infos):
            by_layer[int(index)][key] = tensor
        else:
            undescribed.append(full_name)
    if undescribed:
        raise StatsFileError(f"{path}: the metadata lists {len(infos)} layers but the file holds tensors it does not "
                             f"describe ({sorted(undescribed)[0]}, ...). {fix}")
    signed = {key for cls in STATISTICS.values() for key in cls.signed}
    core = ("gram", *PER_EXPERT_SUMS)
    unregistered = sorted({key for tensors_of in by_layer for key in tensors_of
                           if key not in core and key not in optional_tensors()})
    if unregistered:
        warnings.warn(f"{path} holds statistics no registered extension fills ({', '.join(unregistered)}); they are "
                      "kept in LayerStats.extra (import the extension that collects them to use them).", stacklevel=3)
    layers = []
    for i, info in enumerate(infos):
        name = info.get("name") if isinstance(info, dict) else None
        where = f"{path}, layer {i} ({name})"
        routing = {key: info.get(key) if isinstance(info, dict) else None for key in ROUTING_KEYS}
        bad = {key: value for key, value in routing.items()
               if isinstance(value, bool) or not isinstance(value, int) or value < 1}
        if not isinstance(name, str) or bad:
            raise StatsFileError(f"{where}: the metadata has no valid name or routing ({bad or 'name'}). {fix}")
        n = routing["num_experts"]
        found: dict[str, torch.Tensor] = {}
        # An extension's tensors are kept even when it is not registered here (a plugin not imported, a newer ompmoe)
        present = [*optional_tensors(), *sorted(by_layer[i])]
        for key in dict.fromkeys([*core, *(key for key in present if key in by_layer[i])]):
            tensor = by_layer[i].get(key)
            unsigned = key in core or (extension_providing(key) is not None and key not in signed)
            problem = (f"is missing (the metadata lists layer {i})" if tensor is None
                       else _tensor_problem(key, tensor, n, unsigned))
            if problem:
                raise StatsFileError(f"{where}: tensor {key!r} {problem}. {fix}")
            found[key] = tensor
        layers.append(LayerStats.from_tensors(name, routing, found))  # type: ignore[arg-type]
    return layers


def _tensor_problem(key: str, tensor: torch.Tensor, n: int, unsigned: bool) -> str | None:
    """What is wrong with one tensor of a layer of ``n`` experts (a Gram is ``n x n``), or None."""
    is_gram = key.startswith("gram")
    shape = (n, n) if is_gram else (n,)
    if tuple(tensor.shape) != shape:
        return f"has shape {tuple(tensor.shape)} but the metadata says {n} experts (expected {shape})"
    if tensor.dtype != torch.float64:
        return f"is {tensor.dtype}, expected torch.float64"
    if not bool(torch.isfinite(tensor).all()):
        return "holds NaN or inf values"
    values = tensor.diagonal() if is_gram else tensor
    if (unsigned or is_gram) and bool((values < 0).any()):
        what = "diagonal" if is_gram else "values"
        return f"has negative {what} ({float(values.min())}); these are sums of squares or counts"
    if is_gram:
        gap, scale = float((tensor - tensor.T).abs().max()), float(tensor.abs().max())
        if gap > SYMMETRY_TOLERANCE * max(scale, 1e-300):
            return f"is not symmetric (max |G - G^T| = {gap:.3g}, max |G| = {scale:.3g})"
    return None


FINGERPRINT_CONFIG_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "n_shared_experts", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "norm_topk_prob", "routed_scaling_factor",
    "scoring_func", "topk_method", "n_group", "topk_group", "first_k_dense_replace", "mlp_only_layers",
    "decoder_sparse_step", "tie_word_embeddings",
)
"""Config facts hashed into the fingerprint (absent keys hash as ``None``)."""


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of what the statistics depend on: sizes, attention shapes, routing, every expert/router shape.

    Dtype, attention or experts implementation, weights and the checkpoint path do not change it.
    """
    outer, config = model.config, text_config(model.config)  # a multimodal container's sizes are its text config's

    def shapes(module: torch.nn.Module) -> dict[str, list[int]]:
        return {name: list(p.shape) for name, p in module.named_parameters(recurse=False)}

    payload = {
        "config": {key: _jsonable(_config_value(outer if key == "model_type" else config, key))
                   for key in FINGERPRINT_CONFIG_KEYS},
        "layers": [{"name": layer.name, **layer.routing, "experts": shapes(layer.experts),
                    "router": shapes(layer.router)} for layer in find_moe_layers(model)],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _config_value(config: Any, key: str) -> Any:
    """``config.key``, also where transformers refuses a global read of a per-layer attribute (heterogeneous
    configs): then the value the config serializes."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return config.to_dict().get(key)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return repr(value)
