"""Train the tiny MoE models shipped with ompmoe, with Lightning.

``--architecture qwen3_moe`` (the default) trains ``shipped:tiny-moe`` (``ompmoe/data/tiny-moe/``);
``--architecture glm4_moe`` trains ``shipped:tiny-moe-64`` (``ompmoe/data/tiny-moe-64/``), the fine-grained
model: 64 small routed experts, top-6, one shared expert, group-limited sigmoid routing (8 groups, 4 kept
per token) and a dense first layer, as in DeepSeek-V3 / GLM-4.5; ``--model tiny-moe-a3b`` trains
``shipped:tiny-moe-a3b``, the Qwen3-30B-A3B layout: 64 small routed experts, top-8, softmax router, no shared
expert, every layer sparse.

    python benchmarks/train_tiny_moe.py                         # CPU, 2 threads, about 15-30 minutes
    python benchmarks/train_tiny_moe.py --architecture glm4_moe # shipped:tiny-moe-64, about 30-40 minutes
    python benchmarks/train_tiny_moe.py --model tiny-moe-a3b    # shipped:tiny-moe-a3b, about 30-40 minutes
    python benchmarks/train_tiny_moe.py --accelerator gpu       # the same run on a GPU (bf16-mixed)
    python benchmarks/train_tiny_moe.py --steps 20 --output_dir /tmp/tiny-moe   # smoke test
    python benchmarks/train_tiny_moe.py --init_from ompmoe/data/tiny-moe --steps 300 --lr 1e-3 --seed 1  # continue

Both shipped models were trained in two stages, the default run and then a run continued from its checkpoint
(``--init_from``: the saved weights, a fresh optimizer and schedule, ``--seed 1`` for fresh windows); a continued
run records the stage it started from in ``metrics.json`` and the card lists every stage, the exact commands that
reproduce the shipped weights and the held-out curve over all stages.

Steps (all seeded, ``--seed 0``):

1. Tokenizer: byte-level BPE (``tokenizers``; GPT-2 pre-tokenization, no normalization, so
   ``decode(encode(text)) == text``) with ``--vocab_size`` entries including the single special
   token ``<|endoftext|>`` (end of document and padding), trained on the *train* split of both
   domains of the shipped corpus (``ompmoe/data/corpus/``), saved as a ``PreTrainedTokenizerFast``.
2. Data: each domain's train split as one token stream (documents tokenized on their own,
   ``<|endoftext|>`` between them, as :class:`ompmoe.CalibrationDataModule` builds its stream);
   every training sample is a window of ``--seq_len`` tokens at a uniformly random offset of a
   domain drawn with probability ``--prose_fraction`` for prose (the windows are drawn up front
   from ``torch.Generator().manual_seed(seed)``).
3. Model: ``Qwen3MoeForCausalLM`` from scratch (every layer sparse, ``--num_experts`` routed
   experts, top ``--top_k``, normalized top-k weights, tied embeddings), trained on the causal LM
   loss plus the native load-balancing loss (``output_router_logits=True``,
   ``router_aux_loss_coef``) with AdamW, linear warm-up and cosine decay, gradient clipping 1.0,
   fp32 on CPU (``bf16-mixed`` on GPU). With ``--architecture glm4_moe``: ``Glm4MoeForCausalLM``
   (``--first_k_dense`` dense layers, then sparse ones with ``--n_shared_experts`` shared expert,
   sigmoid router limited to ``--topk_group`` of ``--n_group`` groups), trained on the LM loss alone
   and balanced as DeepSeek-V3 does without an auxiliary loss: after every optimizer step each
   router's ``e_score_correction_bias`` moves by ``--bias_update_speed`` towards the mean load
   (down for experts that got more than their share of the step's tokens, up for the others).
4. Checkpoint: weights cast to ``--save_dtype`` (bfloat16 by default: the fp32 weights would not
   fit the 25 MB budget), ``model.safetensors`` + config + tokenizer in ``--output_dir``.
5. Evaluation of the *saved* checkpoint (loaded back in float32): perplexity of each domain's
   held-out split (all of it, in non-overlapping ``--seq_len`` blocks, every token after the first
   of a block predicted) and of the first ``--gap_tokens`` tokens of its calibration and train
   splits; expert usage from :func:`ompmoe.collect_stats` on the calibration splits (routed-token
   share per expert, normalized entropy, prose-vs-code divergence); with ``--eval_every``, the last
   point of the held-out curve (the end of training) measured again on these weights, replacing the one
   the training loop measured on the float32 weights before the cast. Written to ``metrics.json`` and
   the model card ``README.md`` in ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Passive OpenMP waiting: on a CPU shared with other jobs, spinning threads stall each other (4x slower).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "ompmoe" / "data" / "tiny-moe"
EOS = "<|endoftext|>"
MODELS = {
    "tiny-moe": {"architecture": "qwen3_moe", "num_experts": 16, "top_k": 4, "moe_intermediate_size": 128,
                 "steps": 560, "eval_every": 0, "cpu_experts": "eager"},
    "tiny-moe-64": {"architecture": "glm4_moe", "num_experts": 64, "top_k": 6, "moe_intermediate_size": 32,
                    "steps": 160, "eval_every": 20, "cpu_experts": "sorted"},
    "tiny-moe-a3b": {"architecture": "qwen3_moe", "num_experts": 64, "top_k": 8, "moe_intermediate_size": 32,
                     "steps": 1000, "eval_every": 50, "cpu_experts": "sorted"},
}
"""Per shipped model (``shipped:<name>``, ``ompmoe/data/<name>``): its architecture, expert shape, training steps
(what fits 30-40 minutes on 2 shared CPU threads), held-out curve interval and CPU experts kernel."""
DEFAULT_MODEL = {"qwen3_moe": "tiny-moe", "glm4_moe": "tiny-moe-64"}
"""The model ``--architecture`` alone trains (and the name of cards recorded before ``--model`` existed)."""


def model_name(metrics: dict[str, Any]) -> str:
    """The shipped name of the model a ``metrics.json`` describes."""
    return metrics.get("name") or DEFAULT_MODEL[metrics.get("architecture", "qwen3_moe")]


def sorted_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts kernel ``sorted``: the same function as transformers' eager loop, with a handful of ops per expert.

    The eager loop builds a one-hot mask, runs ``where`` per expert and indexes the 3D weights per expert, whose
    backward zero-fills and adds a whole-parameter gradient for each of the 64 experts. Here the (token, expert)
    pairs are sorted by expert once, split into per-expert chunks, the weights unbound into views (one stacked
    gradient) and the outputs scattered back with one ``index_add_``: on 2 loaded CPU threads 1.2x faster per
    training step of ``shipped:tiny-moe-64``; gradients equal the eager loop's to float32 rounding."""
    num_top_k = top_k_index.size(-1)
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    token_idx = order // num_top_k
    counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
    outputs = []
    for chunk, gate_up, down in zip(hidden_states[token_idx].split(counts), self.gate_up_proj.unbind(0),
                                    self.down_proj.unbind(0)):
        if chunk.shape[0]:
            outputs.append(torch.nn.functional.linear(self._apply_gate(torch.nn.functional.linear(chunk, gate_up)), down))
    weighted = torch.cat(outputs) * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, token_idx, weighted.to(hidden_states.dtype))


def register_experts_kernels() -> None:
    """Make ``--experts_implementation sorted`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("sorted", sorted_experts_forward)


# ------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(vocab_size: int, max_length: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ompmoe.data import CORPUS_DOMAINS, corpus_documents

    texts = [doc["text"] for domain in CORPUS_DOMAINS for doc in corpus_documents(domain, "train")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def domain_stream(tokenizer: Any, domain: str, split: str) -> torch.Tensor:
    from ompmoe.data import corpus_token_stream

    return corpus_token_stream(tokenizer, domain, split)


# ----------------------------------------------------------------------------------------- data
class RandomWindows(torch.utils.data.Dataset):
    """``num_samples`` windows of ``seq_len`` tokens, each from a random domain at a random offset."""

    def __init__(self, streams: list[torch.Tensor], weights: list[float], num_samples: int, seq_len: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.streams = streams
        self.seq_len = seq_len
        self.domains = torch.multinomial(torch.tensor(weights, dtype=torch.float64), num_samples, replacement=True,
                                         generator=generator)
        highs = torch.tensor([stream.numel() - seq_len for stream in streams], dtype=torch.float64)
        self.offsets = (torch.rand(num_samples, generator=generator, dtype=torch.float64) * (highs[self.domains] + 1)).long()

    def __len__(self) -> int:
        return int(self.domains.numel())

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        stream = self.streams[int(self.domains[index])]
        start = int(self.offsets[index])
        return {"input_ids": stream[start : start + self.seq_len]}


# ---------------------------------------------------------------------------------------- model
def build_config(args: argparse.Namespace, tokenizer: Any) -> Any:
    from transformers import Qwen3MoeConfig

    if args.architecture == "glm4_moe":
        return build_glm4_moe_config(args, tokenizer)
    return Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,  # dense MLP size; unused, every layer is sparse
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2 * args.seq_len,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_loss_coef,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )


def build_glm4_moe_config(args: argparse.Namespace, tokenizer: Any) -> Any:
    """GLM-4.5-style fine-grained MoE: dense first layers, shared expert, group-limited sigmoid routing."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.dense_intermediate_size,  # the dense first layer(s)
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        n_routed_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=args.n_shared_experts,
        n_group=args.n_group,
        topk_group=args.topk_group,
        first_k_dense_replace=args.first_k_dense,
        routed_scaling_factor=args.routed_scaling_factor,
        norm_topk_prob=True,
        num_mtp_layers=0,
        max_position_embeddings=2 * args.seq_len,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )


class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: count each router's top-k picks during a step, then move
    ``e_score_correction_bias`` by ``speed`` towards the mean load (down when overloaded, up otherwise)."""

    def __init__(self, model: torch.nn.Module, speed: float) -> None:
        self.speed = speed
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [torch.zeros(r.e_score_correction_bias.numel()) for r in self.routers]
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(index))

    def _hook(self, index: int) -> Any:
        def count(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if module.training:
                top_k_index = output[2]
                self.counts[index] += torch.bincount(top_k_index.reshape(-1).cpu(), minlength=self.counts[index].numel())
        return count

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases from the counts of the last step and reset them; return the worst max-load/mean-load."""
        worst = 0.0
        for router, counts in zip(self.routers, self.counts):
            mean = counts.mean()
            if mean > 0:
                worst = max(worst, float(counts.max() / mean))
                router.e_score_correction_bias += self.speed * torch.sign(mean - counts).to(router.e_score_correction_bias)
            counts.zero_()
        return worst


def make_module(config: Any, args: argparse.Namespace, curve_streams: dict[str, torch.Tensor] | None = None) -> Any:
    import lightning.pytorch as pl
    from transformers import AutoModelForCausalLM

    class TinyMoETraining(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(config, experts_implementation=args.experts_implementation)
            self.history: list[dict[str, float]] = []
            self.balancer = BiasBalancer(self.model, args.bias_update_speed) if args.architecture == "glm4_moe" else None
            self.max_violation = 0.0
            self.curve: list[dict[str, float]] = []

        def on_train_start(self) -> None:
            if curve_streams and args.eval_every:
                self.curve_point()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.balancer is not None:  # after the optimizer step, as DeepSeek-V3 updates its biases
                self.max_violation = self.balancer.step()
            if curve_streams and args.eval_every and self.global_step % args.eval_every == 0:
                self.curve_point()

        def curve_point(self) -> None:
            """Held-out perplexity of the first ``--curve_blocks`` blocks of each domain, now (on the training weights:
            :func:`evaluate` measures the last point again on the saved ones)."""
            self.model.eval()
            point = heldout_curve_point(self.model, curve_streams, self.global_step, args.curve_blocks, args.seq_len,
                                        args.eval_batch_size)
            self.model.train()
            self.curve.append(point)
            print(json.dumps({"heldout_curve": point}), flush=True)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            ids = batch["input_ids"]
            out = self.model(input_ids=ids, labels=ids, use_cache=False)
            if self.balancer is None:
                aux = out.aux_loss.detach().float()
                lm = out.loss.detach().float() - config.router_aux_loss_coef * aux
                self.log_dict({"lm_loss": lm, "aux_loss": aux}, prog_bar=True)
            else:
                lm = out.loss.detach().float()
                self.log_dict({"lm_loss": lm}, prog_bar=True)
            step = self.global_step + 1
            if step % args.log_every == 0 or step == 1:
                balance = ({"aux_loss": round(float(aux), 4)} if self.balancer is None
                           else {"max_load_over_mean": round(self.max_violation, 3)})  # of the previous step
                entry = {"step": step, "lm_loss": round(float(lm), 4), **balance,
                         "lr": self.lr_schedulers().get_last_lr()[0], "elapsed_s": round(time.perf_counter() - START[0], 1)}
                self.history.append(entry)
                print(json.dumps(entry), flush=True)
            return out.loss

        def configure_optimizers(self) -> Any:
            decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2 and "norm" not in n]
            no_decay = [p for n, p in self.model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
            optimizer = torch.optim.AdamW(
                [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
            )

            def schedule(step: int) -> float:
                if step < args.warmup_steps:
                    return (step + 1) / args.warmup_steps
                progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
                return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return TinyMoETraining()


START = [0.0]


def heldout_curve_point(model: Any, streams: dict[str, torch.Tensor], step: int, blocks: int, seq_len: int,
                        batch_size: int) -> dict[str, float]:
    """One point of the held-out curve: perplexity of the first ``blocks`` blocks of ``seq_len`` tokens of each
    domain's held-out stream, as the model is now."""
    return {"step": step, **{
        domain: round(perplexity(model, stream, seq_len, batch_size, max_tokens=blocks * seq_len)["perplexity"], 3)
        for domain, stream in streams.items()}}


def final_curve(curve: list[dict[str, float]], steps: int, point: dict[str, float]) -> list[dict[str, float]]:
    """The held-out curve of a stage of ``steps`` steps ending at ``point``, the end of training measured on the saved
    weights: it replaces the point the training loop measured at that step on the float32 training weights (before the
    cast to ``--save_dtype``), so the card's last column is the shipped weights' perplexity."""
    return [*(p for p in curve if p["step"] < steps), {**point, "step": steps}]


# ----------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def perplexity(model: Any, stream: torch.Tensor, seq_len: int, batch_size: int = 8, max_tokens: int | None = None) -> dict[str, float]:
    """Perplexity over non-overlapping ``seq_len`` blocks of ``stream`` (the remainder is dropped)."""
    from ompmoe.data import token_blocks

    if max_tokens is not None:
        stream = stream[:max_tokens]
    blocks = token_blocks(stream, seq_len, stream.numel() // seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in blocks.split(batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(nll)
        count += batch[:, 1:].numel()
    return {"perplexity": math.exp(total / count), "nll": total / count, "tokens": count}


def unigram_perplexity(tokenizer: Any, seq_len: int) -> dict[str, float]:
    """Per domain, the held-out perplexity of an add-one-smoothed unigram model of the train split (both domains),
    on the tokens :func:`perplexity` predicts: the baseline a trained model must beat clearly."""
    vocab = len(tokenizer)
    counts = sum(torch.bincount(domain_stream(tokenizer, d, "train"), minlength=vocab).double() for d in ("prose", "code"))
    log_p = ((counts + 1) / (counts.sum() + vocab)).log()
    result = {}
    for domain in ("prose", "code"):
        stream = domain_stream(tokenizer, domain, "heldout")
        blocks = stream[: stream.numel() // seq_len * seq_len].view(-1, seq_len)
        result[domain] = math.exp(-float(log_p[blocks[:, 1:]].mean()))
    return result


def expert_usage(model: Any, tokenizer: Any, seq_len: int, num_blocks: int, model_id: str = "shipped:tiny-moe") -> dict[str, Any]:
    """Routed-token share per expert and layer on each domain's calibration split (ompmoe statistics)."""
    import ompmoe
    from ompmoe.data import token_blocks

    usage: dict[str, Any] = {}
    shares: dict[str, list[torch.Tensor]] = {}
    for domain in ("prose", "code"):
        blocks = token_blocks(domain_stream(tokenizer, domain, "calibration"), seq_len, num_blocks)
        stats = ompmoe.collect_stats(model, blocks.split(8), model_id=model_id, source=f"shipped:{domain}")
        shares[domain] = [layer.token_count.double() / layer.token_count.double().sum() for layer in stats.layers]
        usage.setdefault("layers", [layer.name for layer in stats.layers])
        usage.setdefault("calibration_tokens", {})[domain] = stats.num_tokens
    rows = []
    for index, name in enumerate(usage["layers"]):
        prose, code = shares["prose"][index], shares["code"][index]
        both = (prose + code) / 2
        entropy = float(-(both * both.clamp(min=1e-12).log()).sum() / math.log(both.numel()))
        def kl(p: torch.Tensor, q: torch.Tensor) -> float:
            used = p > 0  # 0 log 0 = 0; q > 0 wherever p > 0 since q is the mean of p and another
            return float((p[used] * (p[used] / q[used]).log()).sum())

        js = 0.5 * (kl(prose, both) + kl(code, both))
        rows.append({
            "layer": name,
            "share_mix": [round(float(x), 4) for x in both],
            "share_prose": [round(float(x), 4) for x in prose],
            "share_code": [round(float(x), 4) for x in code],
            "normalized_entropy": round(entropy, 4),
            "max_share": round(float(both.max()), 4),
            "min_share": round(float(both.min()), 4),
            "js_prose_code_bits": round(js / math.log(2), 4),
        })
    usage["per_layer"] = rows
    return usage


# ----------------------------------------------------------------------------------- model card
CARD = """---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [{architecture}, mixture-of-experts, {tags}ompmoe, tiny]
---

# {name}: a small {kind} trained here on Python documentation and source

{intro}

## Architecture

{layout}

Parameters: **{total:.2f} M** in all, {routed:.2f} M of them in routed experts; {active:.2f} M active per token. \
Weights stored in **{save_dtype}** (`model.safetensors`, {megabytes:.1f} MB; {storage}); load with \
`dtype=torch.float32` on a CPU (ompmoe does so for {loads}). All numbers below are measured on the saved \
{measured}weights loaded in float32.

## Training

{steps} steps of {batch_size} x {seq_len} tokens ({tokens:.2f} M tokens; windows at random offsets, prose with \
probability {prose_fraction}, code otherwise), AdamW (lr {lr}, betas 0.9/0.95, weight decay {weight_decay}), \
{warmup_steps} warm-up steps then cosine decay to {min_lr_ratio} x lr, gradient clipping 1.0; loss = causal LM loss\
{balance}Training took {minutes:.1f} min ({total_minutes:.1f} min with tokenizer and evaluation) on {device} \
({threads} threads, {experts_implementation} experts, torch {torch}, transformers {transformers}).{stages}

Final training LM loss {lm_loss:.3f} (mean of the last {window} logged steps){final}

## Held-out perplexity

Per domain, on the whole held-out split (`ompmoe/data/corpus/<domain>-heldout.jsonl.gz`; documents never seen in
training), non-overlapping blocks of {seq_len} tokens, every token after the first of a block predicted.
The calibration and train columns use the first {gap_tokens:,} tokens of those splits (for the generalization gap).
{perplexity}

## How the experts are used

Share of routed token slots per expert (each token counts once for each of its top-{top_k} experts), from \
`ompmoe.collect_stats` (`LayerStats.token_count`) on the calibration
splits ({prose_tokens:,} prose + {code_tokens:,} code tokens). Entropy is normalized by log(number of experts) \
(1.0: perfectly uniform load); JS is the Jensen-Shannon
divergence in bits between the prose and the code load (0: the domains use the experts alike, 1: disjoint).
{usage}

## Use

```python
import ompmoe, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from ompmoe.data import shipped_model_path

path = shipped_model_path('{name}')
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(path)
```

or `ompmoe fit -c configs/tiny.yaml{fit}` ({fit_model}calibration `source: shipped:mix`).

## License and data

Weights: Apache-2.0, like ompmoe. Training text: CPython 3.11 documentation and standard-library source,
Copyright Python Software Foundation, PSF License Agreement (`ompmoe/data/corpus/LICENSE-PSF.txt`); see
`ompmoe/data/corpus/README.md` for what is in each split.
"""
"""The model card of both shipped models; :func:`model_card` fills in what differs between the architectures."""


def _table(header: list[str], rows: list[list[Any]], align: str = "---:") -> list[str]:
    return ["| " + " | ".join(map(str, header)) + " |", "|---|" + f"{align}|" * (len(header) - 1),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def model_card(metrics: dict[str, Any]) -> str:
    """The card of a trained model (``README.md``), from its ``metrics.json`` alone."""
    cfg, ppl, usage = metrics["config"], metrics["perplexity"], metrics["expert_usage"]
    train = metrics["training"]  # the last stage (its final loss and loss curve); `first` is the stage from scratch
    stages = training_stages(train)
    first = stages[0]
    architecture = metrics.get("architecture", "qwen3_moe")
    name = model_name(metrics)
    glm = architecture == "glm4_moe"
    n = cfg["n_routed_experts"] if glm else cfg["num_experts"]
    k = cfg["num_experts_per_tok"]
    layers = usage["per_layer"]
    perplexity = [[d, f"{ppl[d]['heldout']['perplexity']:.2f}", f"{ppl[d]['heldout']['tokens']:,}",
                   f"{ppl[d]['calibration']['perplexity']:.2f}", f"{ppl[d]['train']['perplexity']:.2f}"]
                  for d in ("prose", "code")]
    header = ["domain", "held-out perplexity", "held-out tokens", "calibration split", "train split"]
    if glm:
        groups = cfg["n_group"]
        per_group = n // groups
        dense = cfg["first_k_dense_replace"]
        history = train["history"][:: max(1, len(train["history"]) // 10)]
        unigram = metrics["unigram_heldout_perplexity"]
        for row in perplexity:
            row.append(f"{unigram[row[0]]:.1f}")
        fields = dict(
            tags="fine-grained-experts, ", kind="fine-grained GLM-4.5-style MoE",
            intro=(
                "The second model shipped with ompmoe (`shipped:tiny-moe-64`), closer to the models users prune than\n"
                "`shipped:tiny-moe`: many small routed experts, a shared expert, group-limited sigmoid routing with a\n"
                "load-balancing bias, and a dense first layer, as in DeepSeek-V3 and GLM-4.5. Trained from scratch by\n"
                f"`benchmarks/train_tiny_moe.py --architecture glm4_moe` (Lightning, seed {train['seed']}) on the train "
                "split of\nthe shipped two-domain corpus (`ompmoe/data/corpus/`: English documentation prose and Python "
                "standard-library\nsource, both from CPython 3.11, PSF License), with the same tokenizer and data as "
                "`shipped:tiny-moe`."),
            layout=(
                f"`Glm4MoeForCausalLM`, {cfg['num_hidden_layers']} decoder layers: the first {dense} dense (MLP width "
                f"{cfg['intermediate_size']}), the other {cfg['num_hidden_layers'] - dense} sparse; hidden size "
                f"{cfg['hidden_size']}, {cfg['num_attention_heads']} attention heads ({cfg['num_key_value_heads']} "
                f"key/value heads, head dim {cfg['head_dim']}, rotary on half of each head). Each sparse layer: "
                f"**{n} routed experts of width {cfg['moe_intermediate_size']}, top-{k}**, plus "
                f"{cfg['n_shared_experts']} shared expert of the same width that every token uses. Router: sigmoid "
                "scores plus a per-expert correction bias (`e_score_correction_bias`, used for choosing experts only); "
                f"the {n} experts form **{groups} groups of {per_group}**, each token first keeps the "
                f"{cfg['topk_group']} groups with the largest sum of their top-2 biased scores, then its top-{k} "
                f"experts inside them; the chosen sigmoid scores are normalized to sum 1 and scaled by "
                f"{cfg['routed_scaling_factor']}. Tied input/output embeddings; vocabulary {cfg['vocab_size']} (the "
                f"byte-level BPE of `shipped:tiny-moe`); trained context {train['seq_len']} tokens.\n\n"
                "For pruning, the groups matter: ompmoe keeps the same number of experts in every group of a layer "
                "(at least\n2, which the top-2 group score needs), so a layer keeps a multiple of "
                f"{groups} experts, at least {2 * groups} of {n}."),
            storage="the routing biases in float32", loads="`shipped:` models", measured="",
            balance=(
                " only. Load balance without an auxiliary loss, as in DeepSeek-V3: after every optimizer step each "
                f"router's correction bias moves by {first['bias_update_speed']} per expert towards the mean load "
                "(down for experts that took more than their share of the step's routed slots, up for the others). "),
            final="\n".join([
                "; busiest expert's load over the mean load in the worst layer, per step: "
                f"{train['final_max_load_over_mean']:.2f} (1.0 is perfect balance).", "",
                "Training curve of the last stage (LM loss on the training batch; `metrics.json` has every logged step):",
                "", *_table(["step", *(h["step"] for h in history)],
                            [["LM loss", *(f"{h['lm_loss']:.2f}" for h in history)]]),
            ]),
            perplexity="\n".join([
                "", "The unigram column is the baseline: an add-one-smoothed unigram model of the train split (both "
                "domains) on", "the same held-out tokens.", "",
                *_table([*header, "unigram baseline"], perplexity)]),
            usage="\n".join([
                f"Uniform load is {1 / n:.2%} per expert.", "",
                *_table(["layer", "normalized entropy", "min share", "max share", "experts under 0.5%",
                         "JS(prose, code) bits"],
                        [[r["layer"], f"{r['normalized_entropy']:.3f}", f"{r['min_share']:.4f}", f"{r['max_share']:.4f}",
                          sum(x < 0.005 for x in r["share_mix"]), f"{r['js_prose_code_bits']:.3f}"] for r in layers]),
                "", f"Load per router group (percent of routed slots in experts {per_group}g..{per_group}g+"
                f"{per_group - 1}, both calibration splits together):", "",
                *_table(["layer", *(f"group {g}" for g in range(groups))],
                        [[r["layer"], *(f"{100 * sum(r['share_mix'][g * per_group:(g + 1) * per_group]):.1f}"
                                        for g in range(groups))] for r in layers]),
                "", "Per-expert and per-domain histograms are in `metrics.json` (`expert_usage.per_layer[*].share_mix` /",
                "`share_prose` / `share_code`)."]),
            fit=" --model.model shipped:tiny-moe-64", fit_model="",
        )
    else:
        total_tokens = sum(stage["tokens"] for stage in stages)
        passes = {d: total_tokens * (train["prose_fraction"] if d == "prose" else 1 - train["prose_fraction"])
                  / train["train_tokens"][d] for d in ("prose", "code")}
        default = name == "tiny-moe"
        fields = dict(
            tags="" if default else "fine-grained-experts, ", kind="Qwen3-MoE",
            intro=(
                "The embedded default model of ompmoe (`shipped:tiny-moe`, `configs/tiny.yaml`): a real "
                "Mixture-of-Experts\nlanguage model whose experts learned something, small enough to ship in the "
                "repository and to calibrate\nand prune on a CPU in seconds. Trained from scratch by "
                f"`benchmarks/train_tiny_moe.py` (Lightning, seed {train['seed']}) on the train split of the shipped "
                "two-domain corpus (`ompmoe/data/corpus/`: English\ndocumentation prose and Python standard-library "
                "source, both from CPython 3.11, PSF License)." if default else
                f"The third model shipped with ompmoe (`shipped:{name}`), in the layout of Qwen3-30B-A3B: many small "
                "routed experts,\na softmax router with normalized top-k weights, no shared expert and every layer "
                "sparse. Trained from scratch by\n"
                f"`benchmarks/train_tiny_moe.py --model {name}` (Lightning, seed {train['seed']}) on the train split "
                "of the shipped two-domain corpus\n(`ompmoe/data/corpus/`: English documentation prose and Python "
                "standard-library source, both from CPython 3.11,\nPSF License), with the same tokenizer and data as "
                "`shipped:tiny-moe`."),
            layout=(
                f"`Qwen3MoeForCausalLM`, {cfg['num_hidden_layers']} decoder layers, all sparse; hidden size "
                f"{cfg['hidden_size']}, {cfg['num_attention_heads']} attention heads ({cfg['num_key_value_heads']} "
                f"key/value heads, head dim {cfg['head_dim']}); **{n} routed experts per layer, top-{k}** (softmax "
                f"router, normalized top-k weights), expert intermediate size {cfg['moe_intermediate_size']}; no shared "
                f"expert; tied input/output embeddings; vocabulary {cfg['vocab_size']} (byte-level BPE trained on the "
                f"same train split, `<|endoftext|>` ends documents and pads); trained context {train['seq_len']} tokens."),
            storage="float32 would not fit the repository's 25 MB budget",
            loads="`shipped:tiny-moe`" if default else "`shipped:` models",
            measured="bf16 ",
            balance=(f" + {cfg['router_aux_loss_coef']} x the native load-balancing loss (`output_router_logits=True`). "),
            final=(f", load-balancing loss {train['final_aux_loss']:.3f} (transformers' `load_balancing_loss_func`, over "
                   f"the router logits of all layers together; {k}.0, the top-k, at perfectly balanced routing)."),
            perplexity="\n".join([
                "", *_table(header, perplexity), "",
                f"Training made {passes['prose']:.1f} passes over the prose train split and {passes['code']:.1f} over "
                "the code train split (sampling both domains equally); the gap between the train and held-out columns "
                "is how much of its training text the model memorized, far more for code than for prose.",
                "The calibration and held-out splits are different documents, hence their different perplexities."]),
            usage="\n".join([
                "", "The native loss balances the load summed over all layers, not each layer, so single layers keep "
                "rarely used",
                f"experts: {sum(r['min_share'] < 0.005 for r in layers)} of {len(layers)} layers have an expert with "
                "under 0.5% of the slots, while the busiest expert of a layer takes "
                f"{min(r['max_share'] for r in layers):.0%} to {max(r['max_share'] for r in layers):.0%} (uniform: "
                f"{1 / n:.1%}).", "",
                *_table(["layer", "normalized entropy", "min share", "max share", "JS(prose, code) bits"],
                        [[r["layer"], f"{r['normalized_entropy']:.3f}", f"{r['min_share']:.3f}", f"{r['max_share']:.3f}",
                          f"{r['js_prose_code_bits']:.3f}"] for r in layers]),
                "", "Load histogram (percent of routed slots per expert 0..N-1, prose and code calibration splits "
                "together):", "",
                *_table(["layer", *range(n)],
                        [[r["layer"].split(".")[2] if r["layer"].count(".") >= 2 else r["layer"],
                          *(f"{100 * x:.1f}" for x in r["share_mix"])] for r in layers]),
                "", "Per-domain histograms are in `metrics.json` (`expert_usage.per_layer[*].share_prose` / "
                "`share_code`)."]),
            fit="" if default else f" --model.model shipped:{name}",
            fit_model="`model: shipped:tiny-moe`, " if default else "",
        )
    params = metrics["parameters"]
    return CARD.format(
        architecture=architecture, name=name,
        total=params["total"] / 1e6, routed=params["experts"] / 1e6, active=params["active_per_token"] / 1e6,
        save_dtype=metrics["save_dtype"], megabytes=metrics["checkpoint_bytes"] / 1e6,
        steps=first["steps"], batch_size=first["batch_size"], seq_len=first["seq_len"], tokens=first["tokens"] / 1e6,
        prose_fraction=first["prose_fraction"], lr=first["lr"], weight_decay=first["weight_decay"],
        warmup_steps=first["warmup_steps"], min_lr_ratio=first["min_lr_ratio"], minutes=first["train_seconds"] / 60,
        total_minutes=first["total_seconds"] / 60, device=first["device"], threads=first["threads"],
        experts_implementation=first["experts_implementation"], torch=first["torch"], transformers=first["transformers"],
        stages="".join("\n" + line for line in stages_lines(metrics)),
        lm_loss=train["final_lm_loss"], window=train["final_window"],
        gap_tokens=train.get("gap_tokens", 16384), top_k=k, prose_tokens=usage["calibration_tokens"]["prose"],
        code_tokens=usage["calibration_tokens"]["code"], **fields,
    )


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Train a shipped tiny MoE (see the module docstring).")
    parser.add_argument("--model", default=None, choices=sorted(MODELS),
                        help="the shipped model to train (default: the one of --architecture)")
    parser.add_argument("--architecture", default=None, choices=sorted(DEFAULT_MODEL),
                        help="qwen3_moe: shipped:tiny-moe; glm4_moe: shipped:tiny-moe-64 (default: --model's)")
    parser.add_argument("--output_dir", default=None, help="default ompmoe/data/<--model>")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu", "cuda", "auto"])
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="560 (qwen3_moe) / 160 (glm4_moe)")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--prose_fraction", type=float, default=0.5)
    parser.add_argument("--vocab_size", type=int, default=4096)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=6)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--num_experts", type=int, default=None, help="routed experts per layer (16 / 64)")
    parser.add_argument("--top_k", type=int, default=None, help="experts per token (4 / 6)")
    parser.add_argument("--moe_intermediate_size", type=int, default=None, help="expert width (128 / 32)")
    parser.add_argument("--aux_loss_coef", type=float, default=0.01, help="qwen3_moe load-balancing loss weight")
    parser.add_argument("--n_group", type=int, default=8, help="glm4_moe: router groups")
    parser.add_argument("--topk_group", type=int, default=4, help="glm4_moe: groups kept per token")
    parser.add_argument("--n_shared_experts", type=int, default=1, help="glm4_moe: shared experts")
    parser.add_argument("--first_k_dense", type=int, default=1, help="glm4_moe: leading dense layers")
    parser.add_argument("--dense_intermediate_size", type=int, default=1024, help="glm4_moe: dense MLP width")
    parser.add_argument("--routed_scaling_factor", type=float, default=2.5, help="glm4_moe: routed output scale")
    parser.add_argument("--bias_update_speed", type=float, default=0.002,
                        help="glm4_moe: step of the loss-free balancing bias per optimizer step (DeepSeek-V3's gamma)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min_lr_ratio", type=float, default=0.1)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--experts_implementation", default=None,
                        help="transformers experts kernel or `sorted` (this script's, see sorted_experts_forward); default on "
                             "CPU eager for qwen3_moe, sorted for glm4_moe (1.2x faster than eager there, eager and "
                             "grouped_mm are alike on CPU); grouped_mm on GPU")
    parser.add_argument("--save_dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--eval_batch_size", type=int, default=8)
    parser.add_argument("--gap_tokens", type=int, default=16384, help="tokens of the calibration/train splits evaluated")
    parser.add_argument("--usage_blocks", type=int, default=32, help="calibration blocks per domain for expert usage")
    parser.add_argument("--eval_every", type=int, default=None,
                        help="every N steps, held-out perplexity of the first --curve_blocks blocks per domain (0: off; "
                             "default 0 for qwen3_moe, 20 for glm4_moe)")
    parser.add_argument("--curve_blocks", type=int, default=8)
    parser.add_argument("--init_from", default=None, help="start from the weights of this saved checkpoint")
    parser.add_argument("--card_only", action="store_true", help="rewrite README.md from --output_dir/metrics.json")
    parser.add_argument("--eval_only", action="store_true",
                        help="re-evaluate the checkpoint in --output_dir (keeping metrics.json's training record)")
    args = parser.parse_args(argv)
    args.command = " ".join(["python benchmarks/train_tiny_moe.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    args.model = args.model or DEFAULT_MODEL[args.architecture or "qwen3_moe"]
    if args.architecture not in (None, MODELS[args.model]["architecture"]):
        parser.error(f"--model {args.model} is a {MODELS[args.model]['architecture']} model, not {args.architecture}")
    args.name = args.model
    for key, value in MODELS[args.model].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.output_dir = args.output_dir or str(DEFAULT_OUT.parent / args.name)
    if args.card_only:
        metrics = json.loads((Path(args.output_dir) / "metrics.json").read_text(encoding="utf-8"))
        if args.architecture == "glm4_moe" and "unigram_heldout_perplexity" not in metrics:
            from transformers import AutoTokenizer

            unigram = unigram_perplexity(AutoTokenizer.from_pretrained(args.output_dir), metrics["training"]["seq_len"])
            metrics["unigram_heldout_perplexity"] = unigram
            (Path(args.output_dir) / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
        (Path(args.output_dir) / "README.md").write_text(model_card(metrics), encoding="utf-8")
        return metrics

    import lightning.pytorch as pl
    import transformers

    START[0] = time.perf_counter()
    torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed, workers=True)
    gpu = args.accelerator in ("gpu", "cuda") or (args.accelerator == "auto" and torch.cuda.is_available())
    args.experts_implementation = args.experts_implementation or ("grouped_mm" if gpu else args.cpu_experts)
    register_experts_kernels()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    if args.eval_only:
        from transformers import AutoTokenizer

        training = json.loads((out / "metrics.json").read_text(encoding="utf-8"))["training"]
        return evaluate(out, AutoTokenizer.from_pretrained(out), args, gpu, training)

    tokenizer = train_tokenizer(args.vocab_size, 2 * args.seq_len)
    streams = [domain_stream(tokenizer, domain, "train") for domain in ("prose", "code")]
    print(f"tokenizer: {len(tokenizer)} entries; train tokens prose {streams[0].numel():,}, code {streams[1].numel():,}", flush=True)
    dataset = RandomWindows(streams, [args.prose_fraction, 1 - args.prose_fraction], args.steps * args.batch_size,
                            args.seq_len, args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=False, num_workers=0)

    config = build_config(args, tokenizer)
    curve_streams = ({domain: domain_stream(tokenizer, domain, "heldout") for domain in ("prose", "code")}
                     if args.eval_every else None)
    module = make_module(config, args, curve_streams)
    if args.init_from:  # continue training a saved checkpoint (same architecture arguments)
        from transformers import AutoModelForCausalLM

        module.model.load_state_dict(AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32).state_dict())
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_steps=args.steps,
        precision="bf16-mixed" if gpu else "32-true",
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=False,
        default_root_dir=tempfile.mkdtemp(prefix="tiny-moe-lightning-"),
    )
    fit_start = time.perf_counter()
    trainer.fit(module, loader)
    train_seconds = time.perf_counter() - fit_start

    model = module.model.cpu().eval()
    model.config.output_router_logits = False  # inference default; training set it on
    save_dtype = getattr(torch, args.save_dtype)
    model.to(save_dtype)
    for router in model.modules():  # routing biases stay float32 (transformers keeps them so when loading)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.data = router.e_score_correction_bias.data.float()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    history = module.history
    window = history[-5:]
    training = {
        "seed": args.seed, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "tokens": args.steps * args.batch_size * args.seq_len, "prose_fraction": args.prose_fraction,
        "train_tokens": {"prose": streams[0].numel(), "code": streams[1].numel()},
        "lr": args.lr, "min_lr_ratio": args.min_lr_ratio, "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay, "train_seconds": round(train_seconds, 1),
        "device": torch.cuda.get_device_name(0) if gpu else f"CPU ({platform.machine()})",
        "threads": args.threads, "experts_implementation": args.experts_implementation,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0],
        "final_lm_loss": sum(h["lm_loss"] for h in window) / len(window),
        **({"final_aux_loss": sum(h["aux_loss"] for h in window) / len(window)} if args.architecture == "qwen3_moe"
           else {"bias_update_speed": args.bias_update_speed,
                 "final_max_load_over_mean": sum(h["max_load_over_mean"] for h in window) / len(window)}),
        "final_window": len(window),
        "command": args.command,
        **(previous_stage(Path(args.init_from), args.architecture) if args.init_from else {}),
        **({"heldout_curve": module.curve, "curve_blocks": args.curve_blocks} if args.eval_every else {}),
        "history": history,
    }
    return evaluate(out, tokenizer, args, gpu, training)


def previous_stage(init_from: Path, architecture: str) -> dict[str, Any]:
    """What a continued run records about the checkpoint it started from: its path, its whole-split held-out
    perplexity and its own training record (``previous_stage``, recursively), so the card can tell every stage and
    the commands that reproduce the weights."""
    record: dict[str, Any] = {"init_from": str(init_from)}
    metrics_path = init_from / "metrics.json"
    if metrics_path.is_file():
        metrics = json.loads(metrics_path.read_text(encoding="utf-8"))
        record["init_heldout_perplexity"] = {d: metrics["perplexity"][d]["heldout"]["perplexity"] for d in ("prose", "code")}
        record["previous_stage"] = metrics["training"]
    return record


def stage_command(stage: dict[str, Any], architecture: str) -> str:
    """The command line of one training stage; runs recorded before the script kept its command get the defaults
    they ran with (plus the experts kernel they used)."""
    if "command" in stage:
        return stage["command"]
    arch = " --architecture glm4_moe" if architecture == "glm4_moe" else ""
    return f"python benchmarks/train_tiny_moe.py{arch} --experts_implementation {stage['experts_implementation']}"


def training_stages(train: dict[str, Any]) -> list[dict[str, Any]]:
    """The training stages of a checkpoint, first (from scratch) to last."""
    stages = [train]
    while "previous_stage" in stages[0]:
        stages.insert(0, stages[0]["previous_stage"])
    return stages


def stages_lines(metrics: dict[str, Any]) -> list[str]:
    """Card paragraphs on continued training (after the first stage's paragraph), the reproducing commands, and the
    held-out curve over all stages (step numbers counted from the start of the first stage)."""
    architecture = metrics.get("architecture", "qwen3_moe")
    stages = training_stages(metrics["training"])
    lines: list[str] = []
    done = stages[0]["steps"]
    for stage in stages[1:]:
        before = stage.get("init_heldout_perplexity", {})
        change = (f" Whole-split held-out perplexity went from prose {before['prose']:.2f} / code {before['code']:.2f}"
                  f" at step {done} to the table's below." if before else "")
        lines += [
            "",
            f"Then **{stage['steps']} steps continued from that checkpoint** (`--init_from`, the saved "
            f"{metrics['save_dtype']} weights, fresh AdamW state): {stage['batch_size']} x {stage['seq_len']} tokens per "
            f"step ({stage['tokens'] / 1e6:.2f} M tokens, windows drawn with seed {stage['seed']}), lr {stage['lr']} with "
            f"{stage['warmup_steps']} warm-up steps then cosine decay to {stage['min_lr_ratio']} x lr, weight decay "
            f"{stage['weight_decay']}; {stage['train_seconds'] / 60:.1f} min on {stage['device']} ({stage['threads']} "
            f"threads, {stage['experts_implementation']} experts). Steps {done} to {done + stage['steps']} in all.{change}",
        ]
        done += stage["steps"]
    lines += [
        "",
        "Reproduce (each command writes the default output directory, `ompmoe/data/"
        f"{model_name(metrics)}/`, the later ones reading it first):",
        "",
        "```bash",
        *(stage_command(stage, architecture) for stage in stages),
        "```",
    ]
    curve, offset = [], 0
    for index, stage in enumerate(stages):
        last = index == len(stages) - 1
        curve += [{**point, "step": point["step"] + offset} for point in stage.get("heldout_curve", [])
                  if last or point["step"] < stage["steps"]]  # a stage's last point is the next stage's first
        offset += stage["steps"]
    if curve:
        blocks = next(stage["curve_blocks"] for stage in stages if "curve_blocks" in stage)
        lines += [
            "",
            f"Held-out perplexity during training (first {blocks} blocks of {stages[-1]['seq_len']} tokens of each",
            "held-out split, so not the same numbers as the whole-split table; steps counted from the first stage's start):",
            "",
            "| step | " + " | ".join(str(point["step"]) for point in curve) + " |",
            "|---|" + "---:|" * len(curve),
        ]
        for domain in ("prose", "code"):
            lines.append(f"| {domain} (subset) | " + " | ".join(f"{point[domain]:.1f}" for point in curve) + " |")
    return lines


CONFIG_KEYS = {
    "qwen3_moe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef",
                  "tie_word_embeddings"),
    "glm4_moe": ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                 "n_group", "topk_group", "first_k_dense_replace", "intermediate_size", "routed_scaling_factor",
                 "norm_topk_prob", "tie_word_embeddings"),
}
"""Config fields recorded in ``metrics.json`` (and checked against the model card by the tests)."""


def evaluate(out: Path, tokenizer: Any, args: argparse.Namespace, gpu: bool, training: dict[str, Any]) -> dict[str, Any]:
    """Measure the saved checkpoint (bf16 weights loaded in float32), the held-out curve's last point included;
    write metrics.json and the model card."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if gpu else "cpu")
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    ppl: dict[str, Any] = {}
    for domain in ("prose", "code"):
        heldout = domain_stream(tokenizer, domain, "heldout")
        ppl[domain] = {
            "heldout": perplexity(saved, heldout, args.seq_len, args.eval_batch_size),
            "calibration": perplexity(saved, domain_stream(tokenizer, domain, "calibration"), args.seq_len,
                                      args.eval_batch_size, max_tokens=args.gap_tokens),
            "train": perplexity(saved, domain_stream(tokenizer, domain, "train"), args.seq_len, args.eval_batch_size,
                                max_tokens=args.gap_tokens),
        }
        print(f"{domain}: held-out perplexity {ppl[domain]['heldout']['perplexity']:.3f}", flush=True)
    if "heldout_curve" in training:  # the end of training, measured again on the weights as saved
        streams = {domain: domain_stream(tokenizer, domain, "heldout") for domain in ("prose", "code")}
        point = heldout_curve_point(saved, streams, training["steps"], training["curve_blocks"], training["seq_len"],
                                    args.eval_batch_size)
        training = {**training, "heldout_curve": final_curve(training["heldout_curve"], training["steps"], point)}
        print(json.dumps({"heldout_curve": point, "weights": "saved"}), flush=True)
    usage = expert_usage(saved.cpu(), tokenizer, args.seq_len, args.usage_blocks, f"shipped:{args.name}")

    expert_params = sum(p.numel() for n, p in saved.named_parameters() if ".experts." in n)  # routed only
    total_params = sum(p.numel() for p in saved.parameters())
    config = saved.config
    num_experts = config.num_experts if args.architecture == "qwen3_moe" else config.n_routed_experts
    metrics = {
        "architecture": args.architecture,
        **({"name": args.name} if args.name != DEFAULT_MODEL[args.architecture] else {}),
        "config": {k: getattr(saved.config, k) for k in CONFIG_KEYS[args.architecture]},
        "parameters": {
            "total": total_params,
            "experts": expert_params,
            "active_per_token": total_params - expert_params + expert_params * config.num_experts_per_tok // num_experts,
        },
        "save_dtype": args.save_dtype,
        "checkpoint_bytes": (out / "model.safetensors").stat().st_size,
        "perplexity": ppl,
        **({"unigram_heldout_perplexity": unigram_perplexity(tokenizer, args.seq_len)}
           if args.architecture == "glm4_moe" else {}),
        "expert_usage": usage,
        "training": {**training, "gap_tokens": args.gap_tokens},
    }
    if not args.eval_only:
        metrics["training"]["total_seconds"] = round(time.perf_counter() - START[0], 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(model_card(metrics), encoding="utf-8")
    print(f"wrote {out} in {metrics['training']['total_seconds'] / 60:.1f} min", flush=True)
    return metrics


if __name__ == "__main__":
    main()
