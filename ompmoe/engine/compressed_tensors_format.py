"""Checkpoints in compressed-tensors' format (``quant_method`` ``compressed-tensors``, what llm-compressor writes:
Kimi K2 Thinking's INT4 experts, the community's W4A16 / W8A16 / FP8-dynamic / NVFP4A16 requants). Three of its
formats are read:

- ``pack-quantized``: a weight ``<m>.weight`` is ``<m>.weight_packed`` (``int32``, ``num_bits``-bit integers packed
  densely along each row, offset by ``2 ** (num_bits - 1)``) beside ``<m>.weight_scale`` (one multiplier per group
  of ``group_size`` inputs, per row, or for the tensor) and ``<m>.weight_shape`` (its ``[rows, cols]``);
- ``float-quantized``: ``<m>.weight`` in FP8 (E4M3) beside ``<m>.weight_scale`` (per row or per tensor);
- ``nvfp4-pack-quantized`` (NVFP4): ``<m>.weight_packed`` (``uint8``, two FP4 (E2M1) codes per byte, the lower nibble
  first) beside ``<m>.weight_scale`` (FP8, one per group of 16 inputs) and ``<m>.weight_global_scale`` (``float32``,
  one per weight, dividing the group scales).

Layer-by-layer runs compute on the weights as compressed-tensors dequantizes them (``value * scale`` in the scale's
dtype; :func:`dequantize`, equal to its ``decompress`` bit for bit, tested) and write the kept experts' tensors as
stored; a compensation's down projections are quantized again as llm-compressor quantizes (:func:`quantize`,
:func:`pack`), except NVFP4 ones, which are written as stored only. Which scheme a weight has is its module's config
group (:func:`scheme_of`), checked against the stored shapes; where compressed-tensors and transformers would read a
weight differently ompmoe refuses, and so where a layer's routed experts are not all stored alike (a kept expert
renumbered could then be read with another scheme). What would be read wrong (zero points, activation-ordered groups,
static activation scales, sparsity, transforms, a KV-cache scheme, block-scaled FP8) is refused by name."""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Any

import torch

from .quantized_files import ComputedSlice, QuantizedCheckpointError

PACKED, SCALE, SHAPE, GLOBAL_SCALE = "_packed", "_scale", "_shape", "_global_scale"
"""A weight ``<m>.weight`` is stored as ``<m>.weight_packed`` (or ``<m>.weight`` itself, FP8), ``<m>.weight_scale``
and (packed integers) ``<m>.weight_shape`` or (NVFP4) ``<m>.weight_global_scale``."""
REFUSED_SUFFIXES = {"_zero_point": "asymmetric zero points", "_g_idx": "activation-ordered groups (g_idx)"}
"""Tensors beside a weight that ompmoe does not apply, so a weight that has one is refused (what each means)."""
NVFP4 = "nvfp4-pack-quantized"
FORMATS = {("int", None): "pack-quantized", ("float", 8): "float-quantized", ("float", 4): NVFP4}
"""The compressed-tensors format ompmoe reads for each weight type and width (``None``: any of 1 to 8 bits)."""
NVFP4_GROUP = 16
"""Inputs sharing one FP8 scale in NVFP4."""
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitude of an FP4 (E2M1) code's lower three bits; the fourth is the sign."""
SCALE_DTYPES = ("BF16", "F16", "F32")
"""The scales' safetensors dtypes (the dequantized values take theirs)."""
SCALE_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
"""Each of :data:`SCALE_DTYPES` as a torch dtype (what scales quantized again are computed and stored in)."""
ACTIVATION_SCALES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".input_global_scale")
"""Static activation (or KV-cache) scales: calibrated on the unpruned model's activations, so refused."""
FIX = "Prune the full-precision checkpoint, then quantize the pruned model (llm-compressor's oneshot)."


def compressed_tensors_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (a ``quantization_config`` with ``quant_method`` ``compressed-tensors``) checked: compressed
    weights in a format ompmoe reads, symmetric, without activation scales calibrated for the unpruned model; any
    other variant is refused here, before anything is read."""
    status = settings.get("quantization_status", "compressed")
    wrong = []
    if status != "compressed":
        wrong.append(f"quantization_status={status!r} (its files do not store the compressed weights)")
    sparsity = settings.get("sparsity_config")
    if sparsity and (sparsity.get("format") if isinstance(sparsity, dict) else None) != "dense":  # dense: none
        wrong.append("a sparsity_config")
    for key, what in (("transform_config", "a transform_config (rotations)"),
                      ("kv_cache_scheme", "a kv_cache_scheme (KV-cache scales calibrated for the unpruned model)"),
                      ("moe_sparsity_config", "a moe_sparsity_config (experts already pruned by compressed-tensors)")):
        if settings.get(key):
            wrong.append(what)
    groups = settings.get("config_groups") or {}
    if not groups:
        wrong.append("no config_groups")
    for name, group in groups.items():
        wrong.extend(f"config_groups.{name}: {problem}" for problem in _group_problems(group, settings.get("format")))
    linear = [name for name, group in groups.items() if "Linear" in (group.get("targets") or [])]
    if len(linear) > 1:
        wrong.append(f"config groups {', '.join(linear)} all target Linear (which one stores a weight is ambiguous)")
    if wrong:
        raise QuantizedCheckpointError(
            f"The checkpoint is quantized with compressed-tensors in a way ompmoe does not read: {'; '.join(wrong)}. "
            "ompmoe reads symmetric pack-quantized integer weights (per group, channel or tensor), float-quantized "
            "FP8 weights (per channel or tensor) and nvfp4-pack-quantized NVFP4 weights (FP4 per group of 16 with a "
            f"global scale), with dynamic or no activation quantization. {FIX}")
    return dict(settings)


def _group_problems(group: dict[str, Any], default_format: str | None) -> list[str]:
    """What in one config group ompmoe would read wrong (empty: nothing)."""
    weights = group.get("weights")
    if not weights:
        return ["no weights scheme (activations only)"]
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    problems = []
    form = group.get("format") or default_format
    expected = FORMATS.get((kind, None if kind == "int" else bits))
    if kind == "float" and bits not in (4, 8):
        problems.append(f"{bits}-bit floats (ompmoe reads FP8 and NVFP4)")
    elif expected is None or form != expected:
        problems.append(f"{kind} weights of {bits} bits in format {form!r} (ompmoe reads int pack-quantized, 8-bit "
                        f"float float-quantized, 4-bit float {NVFP4})")
    elif kind == "int" and not (isinstance(bits, int) and 1 <= bits <= 8):
        problems.append(f"{bits}-bit integers (pack-quantized stores 1 to 8)")
    allowed = (("group", "channel", "tensor") if kind == "int" else ("tensor_group",) if bits == 4
               else ("channel", "tensor"))
    if strategy not in allowed:  # block FP8: transformers 5.24 cannot read such experts
        problems.append(f"strategy {strategy!r}")
    elif strategy == "tensor_group" and weights.get("group_size") != NVFP4_GROUP:
        problems.append(f"FP4 groups of {weights.get('group_size')} (NVFP4's are {NVFP4_GROUP})")
    other = [target for target in group.get("targets") or [] if target != "Linear" and not target.startswith("re:")]
    if other:
        problems.append(f"target {other[0]!r} (ompmoe reads groups that target Linear or re: patterns)")
    if not weights.get("symmetric", True):
        problems.append("asymmetric weights (zero points)")
    if weights.get("actorder") in ("group", "dynamic", True):
        problems.append(f"actorder {weights.get('actorder')!r} (activation-ordered groups)")
    if weights.get("dynamic") not in (False, None):
        problems.append("dynamic weight scales")
    for side in ("input_activations", "output_activations"):
        activations = group.get(side)
        if activations and (side == "output_activations" or activations.get("dynamic") not in (True, "local")):
            problems.append(f"static {side} (scales calibrated for the unpruned model)")
    return problems


def scheme_of(module: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The ``weights`` scheme of the config group that quantizes ``module`` (a module name as the files name it):
    the group one of whose ``re:`` targets matches it, else the group that targets ``Linear`` (every stored quantized
    weight is a linear's), as compressed-tensors matches (its ``re:`` patterns before class names). Refused where
    readers would disagree: two groups matching by pattern (compressed-tensors takes the alphabetically first
    pattern), or a routed expert outside the group transformers reads every routed expert with (the first whose
    ``re:`` targets name experts)."""
    groups = settings.get("config_groups") or {}
    matched = [name for name, group in groups.items()
               if any(target.startswith("re:") and re.match(target[3:], module) for target in group.get("targets", []))]
    if len(matched) > 1:
        raise QuantizedCheckpointError(
            f"{module} is matched by the re: targets of several config groups ({', '.join(matched)}): which scheme "
            f"stores it is ambiguous (readers differ). {FIX}")
    chosen = matched[0] if matched else next((name for name, group in groups.items()
                                              if "Linear" in group.get("targets", [])), None)
    if chosen is None:
        raise QuantizedCheckpointError(f"{module} is stored quantized but no config_groups target of the checkpoint's "
                                       "quantization_config names it; the files and config.json disagree.")
    if ".experts." in f".{module}.":  # transformers dequantizes a layer's routed experts with one group
        theirs = _experts_group(groups) or next(iter(groups))
        if theirs != chosen:
            raise QuantizedCheckpointError(
                f"{module} is stored with config group {chosen!r}, but transformers reads every routed expert with "
                f"group {theirs!r} (the first whose re: targets name experts): the checkpoint does not load as it is "
                f"stored. {FIX}")
    return groups[chosen]["weights"]


def ignored(module: str, settings: dict[str, Any]) -> bool:
    """Whether the ``ignore`` list of ``settings`` keeps ``module`` in full precision (an exact name or a matching
    ``re:`` pattern)."""
    return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module
               for entry in settings.get("ignore") or [])


def unpack(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The signed integers (``int8``, ``[rows, cols]``) packed densely in ``packed`` (``int32`` ``[rows, words]``):
    value ``i`` of a row in bits ``i * bits ..`` of the row's little-endian bit stream, stored offset by
    ``2 ** (bits - 1)`` (compressed-tensors' ``pack_to_int32``). The offset is taken off in wrapping ``int8``
    arithmetic, exact since every value fits."""
    rows = packed.shape[0]
    data = packed.contiguous()
    if sys.byteorder == "big":  # the stream is little-endian within each word
        data = data.view(torch.uint8).view(rows, -1, 4).flip(-1).reshape(rows, -1)
    octets = data.view(torch.uint8).reshape(rows, -1)
    if bits == 8:
        values = octets
    elif 8 % bits == 0:  # whole values per byte (1, 2, 4 bits): each byte's, lowest bits first
        mask = (1 << bits) - 1
        values = torch.stack([(octets >> shift) & mask for shift in range(0, 8, bits)], dim=-1).reshape(rows, -1)
    else:  # values straddle bytes: read the bit stream
        stream = ((octets[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(rows, -1).to(torch.int32)
        weights = 1 << torch.arange(bits, dtype=torch.int32)
        values = (stream[:, :cols * bits].reshape(rows, cols, bits) * weights).sum(-1, dtype=torch.int32)
        values = values.to(torch.uint8)
    return values[:, :cols].view(torch.int8) - (1 << (bits - 1))


def dequantize(values: torch.Tensor, scale: torch.Tensor, scheme: dict[str, Any]) -> torch.Tensor:
    """``values`` (integers or FP8, ``[rows, cols]``) times their multipliers in ``scale`` by ``scheme``'s strategy,
    computed in the scale's dtype, as compressed-tensors' ``dequantize`` does (its value, bit for bit)."""
    rows, cols = values.shape
    product = values.to(scale.dtype)
    strategy = scheme["strategy"]
    if strategy == "group":
        size = int(scheme["group_size"])
        return (product.reshape(rows, cols // size, size) * scale.reshape(rows, -1, 1)).reshape(rows, cols)
    return product * scale.reshape(rows, 1) if strategy == "channel" else product * scale.reshape(())


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The bfloat16 values ``[rows, 2 * bytes]`` of an NVFP4 weight, as compressed-tensors' ``decompress`` gives them
    (bit for bit): each code's E2M1 value times its group's FP8 scale (in bfloat16) over the global scale, in the
    dtype torch's promotion gives that quotient (float32 for a ``[1]`` global scale), as theirs computes it."""
    rows = packed.shape[0]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(rows, -1).long()  # the lower nibble first
    magnitude = torch.tensor(E2M1)[codes & 0x07]
    values = torch.where(codes >= 8, -magnitude, magnitude).to(torch.bfloat16)
    multipliers = scale.to(torch.bfloat16).unsqueeze(-1) / global_scale
    grouped = values.reshape(rows, -1, NVFP4_GROUP).to(multipliers.dtype) * multipliers
    return grouped.reshape(rows, -1).to(torch.bfloat16)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (``int8`` ``[rows, cols]``, each in ``bits`` signed bits) packed densely into ``int32`` words, the
    inverse of :func:`unpack` (compressed-tensors' ``pack_to_int32``)."""
    rows, cols = values.shape
    shifted = (values.to(torch.int32) + (1 << (bits - 1))).to(torch.uint8)
    stream = ((shifted[..., None] >> torch.arange(bits, dtype=torch.uint8)) & 1).reshape(rows, cols * bits)
    words = math.ceil(cols * bits / 32)
    stream = torch.nn.functional.pad(stream, (0, words * 32 - cols * bits)).reshape(rows, words, 32).to(torch.int64)
    unsigned = (stream << torch.arange(32, dtype=torch.int64)).sum(-1)
    return (unsigned - (unsigned >= 2 ** 31).to(torch.int64) * 2 ** 32).to(torch.int32)


def quantize(values: torch.Tensor, scheme: dict[str, Any], scale_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(integers or FP8, multipliers)`` of a weight's ``values`` (``[rows, cols]``) by ``scheme``, computed in
    ``scale_dtype`` as llm-compressor's min-max observer and compressed-tensors' ``calculate_qparams`` and
    ``quantize`` compute them (each group's largest magnitude over half the integer or FP8 range; a zero multiplier
    replaced by the dtype's epsilon); multipliers ``[rows, groups]``, ``[rows, 1]`` or ``[1]``."""
    x = values.to(scale_dtype)
    rows, cols = x.shape
    strategy = scheme["strategy"]
    size = int(scheme["group_size"]) if strategy == "group" else cols
    grouped = x.reshape(1, 1, rows * cols) if strategy == "tensor" else x.reshape(rows, cols // size, size)
    low = torch.clamp(grouped.amin(-1, keepdim=True), max=0)
    high = torch.clamp(grouped.amax(-1, keepdim=True), min=0)
    if scheme["type"] == "int":
        bits = int(scheme["num_bits"])
        bottom, top, span = -(1 << (bits - 1)), (1 << (bits - 1)) - 1, (1 << bits) - 1
    else:
        bottom, top, span = -448.0, 448.0, 896.0
    scale = torch.max(low.abs(), high.abs()) / (torch.tensor(span, dtype=scale_dtype) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype), scale)
    clamped = torch.clamp(grouped / scale, bottom, top)
    quantized = (torch.round(clamped).to(torch.int8) if scheme["type"] == "int"
                 else clamped.to(torch.float8_e4m3fn))
    shape = [1] if strategy == "tensor" else [rows, cols // size]
    return quantized.reshape(rows, cols), scale.reshape(shape)


class CompressedSlice(ComputedSlice):
    """A compressed-tensors weight of the files read as its dequantized values (the scale's dtype), in the model's
    layout (the files' ``[rows, cols]``)."""

    def __init__(self, weight: str, parts: dict[str, Any], scheme: dict[str, Any]) -> None:
        self.weight, self.parts, self.scheme = weight, parts, scheme
        self._shape: list[int] | None = None

    def get_shape(self) -> list[int]:
        """The weight's ``[rows, cols]``: a packed one's stored shape, checked against its words and scales (a
        scheme that does not describe them would be read as other values); an NVFP4 one's two values per byte."""
        if self._shape is None:
            if GLOBAL_SCALE in self.parts:
                rows, width = self.parts[PACKED].get_shape()
                self._shape = [rows, 2 * width]
            elif PACKED in self.parts:
                shape = [int(size) for size in self.parts[SHAPE][:].tolist()]
                problem = _unpacked_problem(self.weight, shape, self.parts, self.scheme)
                if problem:
                    raise QuantizedCheckpointError(f"{problem}: its config group's scheme does not describe it. {FIX}")
                self._shape = shape
            else:
                self._shape = list(self.parts[""].get_shape())
        return self._shape

    def get_dtype(self) -> str:
        return "BF16" if GLOBAL_SCALE in self.parts else self.parts[SCALE].get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        if GLOBAL_SCALE in self.parts:
            return dequantize_fp4(self.parts[PACKED][:], self.parts[SCALE][:], self.parts[GLOBAL_SCALE][:])[index]
        if PACKED in self.parts:
            values = unpack(self.parts[PACKED][:], int(self.scheme["num_bits"]), self.get_shape()[1])
        else:
            values = self.parts[""][:]
        return dequantize(values, self.parts[SCALE][:], self.scheme)[index]


def _sparse_packing(weight: str, rows: int, words: int, cols: int, bits: int) -> str | None:
    """The problem of a weight of ``cols`` ``bits``-bit values packed ``32 // bits`` to an int32 word, none across
    words, as compressed-tensors packed 3, 5, 6 and 7 bits before its dense packing (``None``: not that layout)."""
    if 32 % bits and words == math.ceil(cols / (32 // bits)) != math.ceil(cols * bits / 32):
        return (f"{weight}{PACKED} [{rows}, {words}] holds {32 // bits} {bits}-bit values per int32 word, as "
                "compressed-tensors packed them before its dense packing; current compressed-tensors and "
                "transformers read it as other values")
    return None


def _unpacked_problem(weight: str, shape: list[int], parts: dict[str, Any], scheme: dict[str, Any]) -> str | None:
    """What does not fit between a packed weight's stored ``shape``, its words and its scales under ``scheme``."""
    rows, words = parts[PACKED].get_shape()
    bits, grid = int(scheme["num_bits"]), list(parts[SCALE].get_shape())
    if len(shape) == 2 and shape[0] == rows and (old := _sparse_packing(weight, rows, words, shape[1], bits)):
        return old
    if len(shape) != 2 or shape[0] != rows or math.ceil(shape[1] * bits / 32) != words:
        return (f"{weight}{PACKED} [{rows}, {words}] does not hold {weight}{SHAPE} {shape} in {bits}-bit values "
                f"({weight}{SHAPE} and the scheme's num_bits disagree)")
    expected = {"group": [rows, math.ceil(shape[1] / int(scheme.get("group_size") or 1))], "channel": [rows, 1]}
    strategy = scheme["strategy"]
    if strategy == "group" and shape[1] % int(scheme["group_size"]):
        return f"{weight} has {shape[1]} columns, not whole groups of {scheme['group_size']}"
    if (grid != expected[strategy]) if strategy in expected else math.prod(grid) != 1:
        return f"{weight}{SCALE} {grid} is not one multiplier per {strategy} of {weight} {shape}"
    return None


def pair_compressed(headers: dict[str, str], shapes: dict[str, list[int]], settings: dict[str, Any] | None,
                    source: str | os.PathLike) -> dict[str, dict[str, str]]:
    """``{weight: {suffix: file tensor}}`` for the compressed-tensors weights of the files (``headers``: name ->
    safetensors dtype), each checked against its config group's scheme: packed weights without a
    ``quantization_config`` saying so, a missing or misshapen scale or shape, or a tensor ompmoe would not apply
    (zero points, g_idx, global or input scales) are refused by name."""
    packed = sorted(name[:-len(PACKED)] for name, dtype in headers.items() if name.endswith(".weight" + PACKED))
    if settings is None:
        if packed:
            raise QuantizedCheckpointError(
                f"{source} stores {len(packed)} packed integer weights ({packed[0]}{PACKED}, ...) but its config.json "
                "has no quantization_config with quant_method 'compressed-tensors'; they would not be read as "
                "weights. Add the quantization_config the checkpoint was released with.")
        return {}
    fp8 = sorted(name for name, dtype in headers.items() if dtype.startswith("F8_") and name.endswith(".weight"))
    if not packed and not fp8:
        raise QuantizedCheckpointError(
            f"{source}'s config.json says its weights are compressed-tensors (quantization_config), but its files "
            "hold no <name>.weight_packed or FP8 <name>.weight; remove the quantization_config from config.json if "
            "the weights are full precision.")
    pairs, wrong = {}, []
    for weight in [*packed, *fp8]:
        module = weight[:-len(".weight")]
        scheme = scheme_of(module, settings)
        problem = _stored_problem(weight, headers, shapes, scheme, weight in packed, settings)
        if problem:
            wrong.append(problem)
            continue
        pairs[weight] = ({PACKED: weight + PACKED, SCALE: weight + SCALE, GLOBAL_SCALE: weight + GLOBAL_SCALE}
                         if weight in packed and _is_fp4(scheme) else
                         {PACKED: weight + PACKED, SCALE: weight + SCALE, SHAPE: weight + SHAPE} if weight in packed
                         else {"": weight, SCALE: weight + SCALE})
    wrong.extend(_mixed_experts(headers))
    activations = sorted(name for name in headers if name.endswith(ACTIVATION_SCALES))
    wrong.extend(f"{name} (an activation scale calibrated for the unpruned model)" for name in activations[:1])
    if wrong:
        raise QuantizedCheckpointError(f"{source} stores compressed-tensors weights ompmoe cannot read: "
                                       f"{'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}. {FIX}")
    return pairs


def _mixed_experts(headers: dict[str, str]) -> list[str]:
    """Routed experts stored some quantized (packed or FP8), some in full precision, by expert, by projection or by
    layer: transformers reads a layer's experts with one scheme (such a checkpoint does not load, or loads a
    projection unfilled), and a kept expert renumbered would be read under another number's scheme."""
    stored: dict[tuple[str, str], dict[int, bool]] = {}
    for name, dtype in headers.items():
        found = re.match(r"(.*\.experts)\.(\d+)\.(.+)\.weight(_packed)?$", name)
        if found:
            quantized = name.endswith(PACKED) or dtype.startswith("F8_")
            stored.setdefault((found[1], found[3]), {})[int(found[2])] = quantized
    problems = []
    alike: dict[str, dict[str, bool]] = {}  # experts module -> projection -> whether all its experts are quantized
    for (experts, projection), quantized in sorted(stored.items()):
        plain = sorted(number for number, is_quantized in quantized.items() if not is_quantized)
        if plain and len(plain) < len(quantized):
            problems.append(f"{experts}.{{{', '.join(map(str, plain[:3]))}{', ...' if len(plain) > 3 else ''}}}."
                            f"{projection} are stored in full precision and the layer's other experts quantized "
                            "(transformers reads a layer's experts with one scheme)")
        else:
            alike.setdefault(experts, {})[projection] = not plain
    for experts, projections in alike.items():
        plain = sorted(projection for projection, quantized in projections.items() if not quantized)
        if plain and len(plain) < len(projections):
            problems.append(f"{experts}.*.{plain[0]} are stored in full precision and the layer's other projections "
                            "quantized (transformers reads a layer's experts with one scheme: stock from_pretrained "
                            f"would leave {plain[0]} unloaded)")
    whole = {experts: all(projections.values()) for experts, projections in alike.items()
             if len(set(projections.values())) == 1}
    plain_layers = sorted(experts for experts, quantized in whole.items() if not quantized)
    if plain_layers and len(plain_layers) < len(whole):
        problems.append(f"{plain_layers[0]}{' and others' if len(plain_layers) > 1 else ''} are stored in full "
                        "precision and other layers' experts quantized (transformers' compressed-tensors loading "
                        "fails on such a checkpoint)")
    return problems


def _is_fp4(scheme: dict[str, Any]) -> bool:
    """Whether ``scheme`` (a config group's ``weights``) is NVFP4's: 4-bit floats."""
    return scheme.get("type") == "float" and scheme.get("num_bits") == 4


def _fp4_problem(weight: str, headers: dict[str, str], shapes: dict[str, list[int]]) -> str | None:
    """What is wrong with how the files store the NVFP4 ``weight`` (``None``: nothing)."""
    stored, scale, overall = weight + PACKED, weight + SCALE, weight + GLOBAL_SCALE
    if headers[stored] != "U8" or len(shapes[stored]) != 2:
        return f"{stored} is {headers[stored]} {shapes[stored]}, not 2-D uint8 (two FP4 codes per byte)"
    for part in (scale, overall):
        if part not in headers:
            return f"{weight} has no {part}"
    rows, width = shapes[stored]
    expected = [rows, 2 * width // NVFP4_GROUP]
    if headers[scale] != "F8_E4M3" or list(shapes[scale]) != expected or (2 * width) % NVFP4_GROUP:
        return (f"{scale} is {headers[scale]} {shapes[scale]}, not FP8 (E4M3) scales {expected}: one per "
                f"{NVFP4_GROUP} of {weight}'s {2 * width} columns")
    if headers[overall] != "F32" or list(shapes[overall]) != [1]:  # compressed-tensors' [1] (transformers' too)
        return f"{overall} is {headers[overall]} {shapes[overall]}, not one float32 global scale"
    return None


def _stored_problem(weight: str, headers: dict[str, str], shapes: dict[str, list[int]], scheme: dict[str, Any],
                    packed: bool, settings: dict[str, Any]) -> str | None:
    """What is wrong with how the files store ``weight`` for ``scheme`` (``None``: nothing)."""
    for suffix, what in REFUSED_SUFFIXES.items():
        if weight + suffix in headers:
            return f"{weight}{suffix} ({what})"
    if ignored(weight.removesuffix(".weight"), settings):
        return f"{weight} is stored quantized, but the quantization_config's ignore list names it"
    if (scheme.get("type") == "int" or _is_fp4(scheme)) != packed:
        stored = "packed values" if packed else f"FP8 ({headers[weight]})"
        return (f"{weight} is stored as {stored} but its config group quantizes {scheme.get('num_bits')}-bit "
                f"{scheme.get('type')} weights")
    if _is_fp4(scheme):
        return _fp4_problem(weight, headers, shapes)
    if weight + GLOBAL_SCALE in headers:
        return f"{weight}{GLOBAL_SCALE} (a global scale, which only NVFP4 weights have)"
    scale = weight + SCALE
    if scale not in headers:
        return f"{weight} has no {scale}"
    if headers[scale] not in SCALE_DTYPES:
        return f"{scale} is {headers[scale]}, not floating-point multipliers"
    if not packed and headers[scale] == "F16":
        return (f"{scale} is F16 (transformers and compressed-tensors round FP8 weights with half-precision scales "
                "differently; ompmoe reads bf16 or float32 scales)")
    if packed:
        stored = weight + PACKED
        if weight + SHAPE not in headers:
            return f"{weight} has no {weight + SHAPE}"
        if headers[stored] != "I32" or len(shapes[stored]) != 2 or list(shapes[weight + SHAPE]) != [2]:
            return f"{stored} is {headers[stored]} {shapes[stored]}, not 2-D int32 words beside a [2] weight_shape"
        rows, words = shapes[stored]
    else:
        if headers[weight] != "F8_E4M3" or len(shapes[weight]) != 2:
            return f"{weight} is {headers[weight]} {shapes[weight]}, not a 2-D FP8 (E4M3) weight"
        rows = shapes[weight][0]
    strategy, grid = scheme["strategy"], list(shapes[scale])
    if strategy == "group":
        size, bits = int(scheme["group_size"]), int(scheme["num_bits"])
        expected = [rows, grid[-1] if len(grid) == 2 else -1]
        if grid == expected and (old := _sparse_packing(weight, rows, words, grid[1] * size, bits)):
            return old
        if grid != expected or math.ceil(grid[1] * size * bits / 32) != words:
            return (f"{scale} {grid} does not cover {weight + PACKED} {shapes[weight + PACKED]} in groups of {size} "
                    f"{bits}-bit values")
    elif strategy == "channel":
        if grid != [rows, 1]:
            return f"{scale} {grid} is not one multiplier per row of {weight} ([{rows}, 1])"
    elif strategy == "tensor":
        if math.prod(grid) != 1:
            return f"{scale} {grid} is not one multiplier for {weight}"
    return None


def stored_names(saved: list[str]) -> set[str]:
    """The integer tensor names a compressed-tensors checkpoint may store for the model tensors ``saved`` (as
    ``save_pretrained`` names them): each weight's packed values (NVFP4's too), shape, zero points and group
    indices."""
    return {name + suffix for name in saved if name.endswith(".weight")
            for suffix in (PACKED, SHAPE, "_zero_point", "_g_idx")}


def describe(settings: dict[str, Any]) -> str:
    """The schemes of ``settings``' config groups as the model card names them (``int4 per group of 32``)."""
    described = []
    for group in (settings.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        kind = (f"int{weights.get('num_bits')}" if weights.get("type") == "int" else
                "NVFP4 (fp4 e2m1" if _is_fp4(weights) else "fp8 e4m3")
        strategy = weights.get("strategy")
        how = {"group": f"per group of {weights.get('group_size')}", "channel": "per channel",
               "tensor": "per tensor", "tensor_group": f"per group of {weights.get('group_size')}, fp8 scales, "
               "a global scale)"}.get(strategy, f"per {strategy}")
        described.append(f"{kind} {how}")
    return "; ".join(dict.fromkeys(described))


def stores_fp4(settings: dict[str, Any]) -> bool:
    """Whether a config group of ``settings`` stores NVFP4 weights."""
    return any(_is_fp4(group.get("weights") or {}) for group in (settings.get("config_groups") or {}).values())


def experts_fp4(settings: dict[str, Any]) -> bool:
    """Whether the routed experts of ``settings`` are NVFP4 (which ompmoe does not quantize again): the scheme of the
    group transformers reads every routed expert with (:func:`_experts_group`, as :func:`scheme_of` checks it)."""
    groups = settings.get("config_groups") or {}
    chosen = _experts_group(groups)
    return chosen is not None and _is_fp4(groups[chosen].get("weights") or {})


def _experts_group(groups: dict[str, Any]) -> str | None:
    """The config group transformers reads every routed expert with: the first whose ``re:`` targets name experts,
    else the one that targets ``Linear`` (``None``: neither)."""
    named = [name for name, group in groups.items()
             if any(target.startswith("re:") and "experts" in target for target in group.get("targets", []))]
    return named[0] if named else next((name for name, group in groups.items()
                                        if "Linear" in group.get("targets", [])), None)


__all__ = ["CompressedSlice", "compressed_tensors_settings", "dequantize", "dequantize_fp4", "describe", "ignored",
           "experts_fp4", "pack", "pair_compressed", "quantize", "scheme_of", "stored_names", "stores_fp4", "unpack"]
