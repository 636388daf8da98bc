"""Literal reference implementations and shared helpers that the ompmoe tests compare against.

Tests import from here (``from reference import ...``); ``conftest.py`` holds only fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from contextlib import contextmanager
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from ompmoe.data import byte_tokens, shipped_text, token_blocks
from ompmoe import MoELayer
from ompmoe.engine.adapters import block_expert_tensors
from ompmoe.engine.tiny import TINY_CONFIGS, tiny_model

TESTS = Path(__file__).resolve().parent
"""The ``tests/`` folder (helper scripts, ``data/``)."""
REPO = TESTS.parent
"""The repository root (``configs/``, ``README.md``)."""

# The tiny models are far too small to gain from intra-op threads; spinning worker threads only
# slow the suite down (by several times on a busy 2-core machine).
torch.set_num_threads(1)

# Every tiny architecture, plus DeepSeek-V2 with its group-limited router.
ARCH_CASES: dict[str, tuple[str, dict]] = {
    **{model_type: (model_type, {}) for model_type in TINY_CONFIGS},
    "deepseek_v2_grouped": ("deepseek_v2", {"topk_method": "group_limited_greedy"}),
}
ARCH_IDS = list(ARCH_CASES)


def make_model(case: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The tiny model of ``case`` (a key of :data:`ARCH_CASES`)."""
    model_type, case_overrides = ARCH_CASES[case]
    return tiny_model(model_type, seed=seed, **{**case_overrides, **overrides})


def random_ids(batch: int = 2, seq: int = 16, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq), generator=generator)


@contextmanager
def capture_block_inputs(layers: list[MoELayer]) -> Iterator[list[list[torch.Tensor]]]:
    """Record every MoE block's input hidden states, flattened to ``(tokens, d)``, per forward call."""
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for index, layer in enumerate(layers):

        def hook(module, args, kwargs, index=index):
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[index].append(hidden.detach().reshape(-1, hidden.shape[-1]).clone())

        handles.append(layer.block.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class LiteralLayer:
    """One layer's statistics computed the slow way, one token and one expert at a time."""

    atoms: torch.Tensor  # (N_e, tokens, d) float64, V_e = g_e F_e, zero where not routed
    gram: torch.Tensor
    routing_mass: torch.Tensor
    token_count: torch.Tensor
    sq_norm_sum: torch.Tensor
    norm_sum: torch.Tensor
    weighted_norm_sum: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "gram": self.gram,
            "routing_mass": self.routing_mass,
            "token_count": self.token_count,
            "sq_norm_sum": self.sq_norm_sum,
            "norm_sum": self.norm_sum,
            "weighted_norm_sum": self.weighted_norm_sum,
        }


@torch.no_grad()
def literal_layer(layer: MoELayer, hidden: torch.Tensor, keep: torch.Tensor | None = None) -> LiteralLayer:
    """Route ``hidden`` (tokens, d) with the layer's own router, run each (token, expert) pair alone.

    ``keep`` (tokens,) bool marks the tokens that count; the others get no atom entry.
    """
    n, (tokens, d) = layer.num_experts, hidden.shape
    keep = torch.ones(tokens, dtype=torch.bool) if keep is None else keep.reshape(-1).bool()
    extra = [getattr(layer.block, name) for name in block_expert_tensors(layer.block, n)]  # MiniMax-M2's bias
    _, weights, index = layer.router(hidden, *extra)
    atoms = torch.zeros(n, tokens, d, dtype=torch.float64)
    sums = {key: torch.zeros(n, dtype=torch.float64) for key in ("mass", "count", "sq", "norm", "wnorm")}
    for t in range(tokens):
        if not keep[t]:
            continue
        for slot in range(index.shape[1]):
            e, g = int(index[t, slot]), float(weights[t, slot])
            out = layer.experts(hidden[t][None], torch.tensor([[e]]), torch.ones(1, 1, dtype=hidden.dtype))
            f = out[0].to(torch.float64)
            atoms[e, t] = g * f
            sums["mass"][e] += g
            sums["count"][e] += 1
            sums["sq"][e] += f.square().sum()
            sums["norm"][e] += f.norm()
            sums["wnorm"][e] += g * f.norm()
    flat = atoms.reshape(n, -1)
    return LiteralLayer(
        atoms=atoms,
        gram=flat @ flat.T,
        routing_mass=sums["mass"],
        token_count=sums["count"],
        sq_norm_sum=sums["sq"],
        norm_sum=sums["norm"],
        weighted_norm_sum=sums["wnorm"],
    )


def assert_gram_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> None:
    """Float32 products: relative tolerance on the entries' scale (the largest diagonal entry)."""
    scale = float(expected.diagonal().max())
    torch.testing.assert_close(actual.to(torch.float64), expected, rtol=rtol, atol=rtol * scale)


def router_inputs(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE block's router input ``(T, d)`` in a plain forward of ``model`` on ``ids``."""
    from ompmoe import find_moe_layers

    seen: list[torch.Tensor] = []
    handles = [layer.router.register_forward_pre_hook(lambda module, args: seen.append(
        args[0].reshape(-1, args[0].shape[-1]).detach())) for layer in find_moe_layers(model)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def output_gradients(model: torch.nn.Module, ids: torch.Tensor, modules: list[torch.nn.Module],
                     output_of=lambda output: output) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per module, its input ``(T, d)`` and the gradient of the literal next-token loss (cross-entropy summed token by
    token in float64) at its output (``output_of`` picks the tensor from what it returns), ``(T, d)`` float64."""
    captured, handles = [], []

    def keep(module, args, output):
        output = output_of(output)
        output.retain_grad()
        captured.append((args[0].reshape(-1, args[0].shape[-1]).detach(), output))

    handles = [module.register_forward_hook(keep) for module in modules]
    try:
        logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    loss = sum(torch.nn.functional.cross_entropy(logits[b, t].float(), ids[b, t + 1]).double()
               for b in range(ids.shape[0]) for t in range(ids.shape[1] - 1))
    loss.backward()
    return [(hidden, output.grad.reshape(-1, output.shape[-1]).double()) for hidden, output in captured]


def assert_loss_sums(layer_stats, token_atoms: list[torch.Tensor], grad: torch.Tensor) -> None:
    """``gram_loss`` and ``loss_first_order`` of ``layer_stats`` against the literal sums of ``a = atoms @ d_x`` over
    tokens (``token_atoms``: each token's ``(N, d)`` atoms, zero for unrouted experts)."""
    n = token_atoms[0].shape[0]
    gram_loss = torch.zeros(n, n, dtype=torch.float64)
    first_order = torch.zeros(n, dtype=torch.float64)
    for atoms, token_grad in zip(token_atoms, grad):
        a = atoms @ token_grad
        gram_loss += torch.outer(a, a)
        first_order += a
    scale = float(gram_loss.abs().max())
    torch.testing.assert_close(layer_stats.gram_loss, gram_loss, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(layer_stats.loss_first_order, first_order, rtol=1e-4,
                               atol=1e-4 * float(first_order.abs().max()))


def assert_compensation_sums(layer_sums, tokens: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A compensation pass's ``gram``, ``cross`` and ``target_energy`` against the literal sums over ``tokens``: each
    token's kept contributions ``(K, d)`` (zero for experts it does not reach) and its target ``(d,)``."""
    import pytest

    k = tokens[0][0].shape[0]
    gram, cross, energy = torch.zeros(k, k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64), 0.0
    for contributions, target in tokens:
        gram += contributions @ contributions.T
        cross += contributions @ target
        energy += float(target @ target)
    assert_gram_close(layer_sums.gram, gram, rtol=1e-4)
    torch.testing.assert_close(layer_sums.cross, cross, rtol=1e-4, atol=1e-4 * float(cross.abs().max()))
    assert float(layer_sums.target_energy) == pytest.approx(energy, rel=1e-4)


# ------------------------------------------------------------------ Lightning test helpers
def batches(num_blocks: int, seq_len: int = 32) -> list[dict[str, torch.Tensor]]:
    blocks = token_blocks(byte_tokens(shipped_text()), seq_len, num_blocks)
    return [{"input_ids": block, "attention_mask": torch.ones_like(block)} for block in blocks]


def trainer(callbacks, **kwargs):
    """A quiet one-epoch CPU Lightning Trainer (no logger, checkpoints, progress bar or summary)."""
    options = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


class ForwardCounter(pl.Callback):
    """Counts the forwards of the LightningModule's model."""

    def __init__(self):
        self.calls = 0

    def on_fit_start(self, trainer, pl_module):
        pl_module.model.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


# ------------------------------------------------------------------ shipped models
def shipped_model(name: str) -> torch.nn.Module:
    """A shipped model as its tests read it: the saved bf16 weights in float32, eval mode."""
    from transformers import AutoModelForCausalLM

    from ompmoe.data import shipped_model_path

    return AutoModelForCausalLM.from_pretrained(shipped_model_path(name), dtype=torch.float32).eval()


def shipped_tokenizer(name: str):
    from transformers import AutoTokenizer

    from ompmoe.data import shipped_model_path

    return AutoTokenizer.from_pretrained(shipped_model_path(name))


def train_split_log_unigram(tokenizer) -> torch.Tensor:
    """Log-probabilities of the add-one-smoothed unigram model of the corpus's train split (both domains): the
    baseline a trained shipped model must beat."""
    from ompmoe.data import CORPUS_DOMAINS, corpus_token_stream

    vocab = len(tokenizer)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for domain in CORPUS_DOMAINS:
        counts += torch.bincount(corpus_token_stream(tokenizer, domain, "train"), minlength=vocab).double()
    return ((counts + 1) / (counts.sum() + vocab)).log()
