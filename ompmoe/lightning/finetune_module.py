"""A LightningModule that fine-tunes a pruned MoE (full or LoRA) with the causal-LM loss (recipe: ``docs/recipes.md``).

LoRA adapters are merged at the end of the fit, so the model written to ``save_dir`` loads with
:func:`ompmoe.load_pruned` like any pruned checkpoint.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import Any, TextIO

from .._quiet import GRADIENT_CHECKPOINTING, passive_omp_threads, quiet_third_party

passive_omp_threads(__name__ == "__main__")  # the command

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.utilities import rank_zero_warn  # noqa: E402
from torch import nn  # noqa: E402

from ..cli_args import fail, user_errors  # noqa: E402
from ..engine.adapters import find_moe_layers  # noqa: E402
from ..engine.export.config import add_finetune_record  # noqa: E402
from ..engine.export.save import save_pruned  # noqa: E402
from ..engine.io import check_writable, inputs_of  # noqa: E402
from ..engine.perplexity import eval_mode  # noqa: E402
from .finetune_loss import LossParts, causal_lm_loss, moe_routers, router_aux_coef  # noqa: E402
from .models import default_tokenizer, load_model, model_and_name, resolve_dtype  # noqa: E402


def attention_linear_names(model: nn.Module) -> list[str]:
    """Leaf names of the ``nn.Linear`` modules inside attention blocks (``self_attn``), sorted."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and ".self_attn." in f".{name}"})


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Suffixes ``experts.<name>`` of the fused 3-D routed-expert weights (PEFT ``target_parameters``)."""
    return sorted({f"experts.{name}" for layer in find_moe_layers(model)
                   for name, parameter in layer.experts.named_parameters(recurse=False) if parameter.dim() == 3})


def _duration(seconds: float) -> str:
    """``45s``, ``4m05s``, ``1h02m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLines(pl.Callback):
    """Plain progress lines for a log file or CI, where a progress bar shows nothing useful, on rank 0's stderr::

        ompmoe: fine-tuning step 12/200, loss 4.3187, 2m05s elapsed, about 32m40s left

    One at the first optimizer step, then every ``every_seconds`` seconds (and every ``every_n_steps`` steps if given),
    and one at the last step. ``loss`` is the mean training loss of the batches since the previous line; the time left
    is the time per step since the first line (validations included; for the first line, since the first batch) times
    the steps left of ``Trainer.estimated_stepping_batches`` (left out when the fit has no step limit).
    :class:`FinetuneModule` adds one when stderr is not a terminal and ``enable_progress_bar`` is on (the default).
    """

    clock = staticmethod(time.monotonic)
    """Seconds, for the elapsed and left times."""

    def __init__(self, every_seconds: float = 30.0, every_n_steps: int | None = None,
                 stream: TextIO | None = None) -> None:
        if every_seconds <= 0 or (every_n_steps is not None and every_n_steps <= 0):
            raise ValueError(f"every_seconds and every_n_steps must be positive; got {every_seconds}, {every_n_steps}.")
        self.every_seconds = float(every_seconds)
        self.every_n_steps = every_n_steps
        self.stream = stream

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning calls this before any other hook that reads these, on every fit.
        self._started = self.clock()  # monotonic time at the start of training
        self._first: tuple[int, float] | None = None  # (global step, time) before the first batch
        self._last: tuple[int, float] | None = None  # (global step, time) of the last line
        self._rate_from: tuple[int, float] | None = None  # (global step, time) of the first line
        self._losses: list[float] = []
        self._total = float(trainer.estimated_stepping_batches)  # optimizer steps of the fit (inf: no limit)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._first is None:  # after the module's own start (FinetuneModule validates the starting model)
            self._first = (int(trainer.global_step), self.clock())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):  # divided by the accumulation count for the backward: undo it
            self._losses.append(float(loss.detach()) * trainer.accumulate_grad_batches)
        step, now = int(trainer.global_step), self.clock()
        if self._first is None or step == self._first[0] or (self._last is not None and step == self._last[0]):
            return  # no optimizer step yet, or this step has its line
        if (self._last is None or step >= self._total or now - self._last[1] >= self.every_seconds
                or (self.every_n_steps is not None and step % self.every_n_steps == 0)):
            self._print(trainer, step, now)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = int(trainer.global_step)
        if self._first is not None and step != self._first[0] and (self._last is None or step != self._last[0]):
            self._print(trainer, step, self.clock())  # stopped early (max_time, a callback)

    def _print(self, trainer: pl.Trainer, step: int, now: float) -> None:
        # The rate runs from the first line on, so that the first step's one-off costs (loading a teacher) do not count.
        since_step, since = self._rate_from or self._first or (step, now)
        self._last, self._rate_from = (step, now), self._rate_from or (step, now)
        losses, self._losses = self._losses, []
        if not trainer.is_global_zero:
            return
        finite = math.isfinite(self._total)
        parts = [f"step {step}/{int(self._total)}" if finite else f"step {step}"]
        if losses:
            parts.append(f"loss {sum(losses) / len(losses):.4f}")
        parts.append(f"{_duration(now - self._started)} elapsed")
        if finite and since_step < step < self._total:
            parts.append(f"about {_duration((now - since) / (step - since_step) * (self._total - step))} left")
        print(f"ompmoe: fine-tuning {', '.join(parts)}", file=self.stream or sys.stderr, flush=True)


class FinetuneModule(pl.LightningModule):
    """Fine-tune a (pruned) Hugging Face MoE on causal-LM batches ``{"input_ids", "attention_mask"}``.

    Args:
        model: A path saved by :func:`ompmoe.save_pruned` (loaded with :func:`ompmoe.load_pruned`,
            any per-layer expert counts), a hub id, ``tiny:<model_type>``, or a model instance.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        lora_rank: 0 for a full fine-tune; otherwise the LoRA rank (needs ``peft``) of the attention ``nn.Linear``
            modules; routers, norms, embeddings and the LM head stay frozen.
        lora_alpha: LoRA scaling numerator (default ``2 * lora_rank``).
        lora_dropout: Dropout on the LoRA input.
        lora_experts: Also adapt the fused routed-expert weights (PEFT ``target_parameters``).
        aux_loss_coef: Weight of the load-balancing loss; ``None``: the model's ``router_aux_loss_coef`` when
            ``config.output_router_logits`` is set, else 0.
        per_layer_aux_loss: Mean of each layer's loss (any expert counts); ``False``: transformers' pooled
            value (uniform counts only).
        dtype: Weights dtype when loading (``None`` keeps the checkpoint's).
        tokenizer: Tokenizer name for ``CalibrationDataModule`` (``bytes`` for tiny models).
        teacher: The unpruned model to distill from (as ``model``): the loss becomes ``(1 - distill_weight) *
            lm_loss + distill_weight * KL(teacher || model)`` per token. ``None``: no distillation.
        distill_weight: Weight of the distillation term (used only with ``teacher``).
        warmup_steps: Linear learning-rate warm-up over this many optimizer steps (0: constant rate).
        keep_best: At the end of training, restore the state (the starting model included) with the best mean
            validation loss if the last is worse, with a warning; keeps one copy of the trainable parameters. Needs
            validation data; without it, nothing is tracked.
        save_dir: Where rank 0 writes the fine-tuned (LoRA-merged) model at the end of the fit, its ``config.json``
            and model card recording the fit (:attr:`finetune_record`).
        overwrite: Replace an existing ``save_dir``.
        trust_remote_code: Passed to ``from_pretrained``.
    """

    def __init__(
        self,
        model: str | nn.Module = "outputs/tiny/model",
        learning_rate: float = 1e-4,
        weight_decay: float = 0.0,
        lora_rank: int = 0,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        lora_experts: bool = True,
        aux_loss_coef: float | None = None,
        per_layer_aux_loss: bool = True,
        teacher: str | nn.Module | None = None,
        distill_weight: float = 0.5,
        warmup_steps: int = 0,
        keep_best: bool = True,
        dtype: str | None = None,
        tokenizer: str | None = None,
        save_dir: str | None = None,
        overwrite: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        super().__init__()
        # Not "tokenizer": the data module records its own, and Lightning refuses two different values of one key.
        self.save_hyperparameters(ignore=["tokenizer", *(["model"] if isinstance(model, nn.Module) else []),
                                          *(["teacher"] if isinstance(teacher, nn.Module) else [])])
        if not 0.0 <= distill_weight <= 1.0:
            raise ValueError(f"distill_weight must lie in [0, 1]; got {distill_weight}.")
        self.teacher_name_or_path = None if isinstance(teacher, nn.Module) else teacher
        self.distills = teacher is not None
        self.distill_weight = float(distill_weight)
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.lora_rank = int(lora_rank)
        self.lora_alpha = lora_alpha
        self.lora_dropout = lora_dropout
        self.lora_experts = lora_experts
        self.aux_loss_coef = aux_loss_coef
        self.per_layer_aux_loss = per_layer_aux_loss
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be 0 or positive; got {warmup_steps}.")
        self.warmup_steps = int(warmup_steps)
        self.keep_best = keep_best
        self.validation_history: list[tuple[int, float]] = []
        """``(global step, mean validation loss)`` of every candidate state, the starting model first."""
        self._best: tuple[int, float, dict[str, torch.Tensor]] | None = None
        self._val_sums: dict[int, list[float]] = {}
        self._set_losses: dict[int, list[float]] = {}  # global step -> each validation set's mean loss there
        self._latest_set_losses: list[float] = []  # of the last validation, for _candidate to file under its step
        self._trained_tokens: torch.Tensor | int = 0  # attended tokens of the training batches (this rank)
        self._lora_targets: tuple[list[str], list[str]] = ([], [])  # (modules, expert parameters) LoRA adapts
        self.finetune_record: dict[str, Any] | None = None
        """What the last fit did (method, loss, steps, data, validation before -> after), set at the end of training and
        added to the model's config (``config.json``'s ``ompmoe.finetune``; ``ompmoe_finetune`` for a model never
        pruned), so the saved checkpoint and its model card say how its weights were trained."""
        self.torch_dtype = resolve_dtype(dtype)
        self.save_dir = save_dir
        self.overwrite = overwrite
        self.trust_remote_code = trust_remote_code
        self.model, self.model_name_or_path = model_and_name(model)
        self.tokenizer_name = default_tokenizer(self.model_name_or_path, tokenizer)
        self._routers: list[tuple[nn.Module, int]] | None = None  # set once, by configure_model
        # Kept out of the module tree: never trained, saved or counted as this module's parameters.
        self.__dict__["_teacher"] = teacher if isinstance(teacher, nn.Module) else None

    def configure_model(self) -> None:
        if self._routers is not None:
            return
        if self.model is None:
            if not self.model_name_or_path:
                raise ValueError("FinetuneModule needs a pruned model path, a hub id, 'tiny:<model_type>' or a model "
                                 "instance.")
            self.model = load_model(self.model_name_or_path, self.torch_dtype, self.trust_remote_code)
        self._routers = moe_routers(self.model)  # before PEFT replaces the experts modules
        if self.lora_rank > 0:
            self.model = self._with_lora(self.model)
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps modules' modes

    def teacher_model(self) -> nn.Module | None:
        """The frozen teacher in eval mode on this module's device (loaded on first use), or ``None``."""
        if not self.distills:
            return None
        if self._teacher is None:
            self.__dict__["_teacher"] = load_model(str(self.teacher_name_or_path), self.torch_dtype,
                                                   self.trust_remote_code)
        return self._teacher.eval().requires_grad_(False).to(self.device)

    def distillation_loss(self, batch: dict[str, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Mean per-token ``KL(teacher || model)`` of the next-token distributions (padding left out)."""
        mask = batch.get("attention_mask")
        with torch.no_grad():
            teacher = self.teacher_model()
            teacher_logits = teacher(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits
        target = torch.log_softmax(teacher_logits.float(), dim=-1)
        per_token = (target.exp() * (target - torch.log_softmax(logits.float(), dim=-1))).sum(-1)
        if mask is None:
            return per_token.mean()
        mask = mask.to(per_token.dtype)
        return (per_token * mask).sum() / mask.sum()

    def _with_lora(self, model: nn.Module) -> nn.Module:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as error:  # pragma: no cover - exercised only without the extra
            raise ImportError("LoRA fine-tuning needs peft: pip install 'ompmoe[recipes]' (or lora_rank=0).") from error
        targets = attention_linear_names(model)
        if not targets:
            raise ValueError(f"Found no nn.Linear inside attention blocks of {type(model).__name__} for LoRA.")
        alpha = self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank
        experts = expert_parameter_names(model) if self.lora_experts else None
        self._lora_targets = (targets, experts or [])
        config = LoraConfig(r=self.lora_rank, lora_alpha=alpha, lora_dropout=self.lora_dropout,
                            target_modules=targets, target_parameters=experts, bias="none")
        with warnings.catch_warnings():  # peft reads a property transformers 5 deprecates; only peft can act on it
            warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING, category=FutureWarning)
            return get_peft_model(model, config)

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model being fine-tuned (inside the PEFT wrapper, if any)."""
        self.configure_model()
        unwrap = getattr(self.model, "get_base_model", None)  # a PEFT wrapper's
        return self.model if unwrap is None else unwrap()

    def merged_model(self) -> nn.Module:
        """The plain Hugging Face model with the LoRA updates merged in (no-op for full fine-tunes).

        Merging ends LoRA training: afterwards the module holds (and trains) the merged model.
        """
        if self.model is not self.hf_model:  # the PEFT wrapper of an unmerged LoRA fine-tune
            self.model = self.model.merge_and_unload()
        return self.model

    def save_pruned(self, path: str | os.PathLike, overwrite: bool = False, tokenizer: Any | None = None) -> None:
        """Merge LoRA (if any) and write the model with :func:`ompmoe.save_pruned`."""
        save_pruned(self.merged_model(), path, tokenizer=tokenizer, overwrite=overwrite)

    @property
    def aux_coef(self) -> float:
        return float(self.aux_loss_coef) if self.aux_loss_coef is not None else router_aux_coef(self.hf_model.config)

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> LossParts:
        """Causal-LM loss (+ per-layer load-balancing loss) of one batch."""
        return causal_lm_loss(self.model, batch, self.aux_coef, self.per_layer_aux_loss, routers=self._routers)

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs, use_cache=False)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        parts = self.compute_loss(batch)
        size = batch["input_ids"].shape[0]
        loss = parts.loss
        if self.distills:
            kl = self.distillation_loss(batch, parts.logits)
            loss = loss + self.distill_weight * (kl - parts.lm_loss)  # (1 - w) * lm + w * kl (+ aux)
            self.log("train_kd_loss", kl, batch_size=size)
        self.log("train_loss", loss, prog_bar=True, batch_size=size)
        mask = batch.get("attention_mask")  # summed on the device: no synchronization per step
        self._trained_tokens = self._trained_tokens + (batch["input_ids"].numel() if mask is None else mask.sum())
        if parts.aux_loss is not None:
            self.log("train_lm_loss", parts.lm_loss, batch_size=size)
            self.log("train_aux_loss", parts.aux_loss, batch_size=size)
        return loss

    def _add_loss(self, sums: dict[int, list[float]], index: int, batch: dict[str, torch.Tensor]) -> LossParts:
        """The loss of one validation batch, added to ``sums[index]`` as ``[loss * blocks, blocks]``."""
        parts = self.compute_loss(batch)
        size = batch["input_ids"].shape[0]
        total = sums.setdefault(index, [0.0, 0.0])
        total[0] += float(parts.lm_loss) * size
        total[1] += size
        return parts

    def _val_names(self) -> list[str]:
        """The validation sets' names of a :class:`ompmoe.FinetuneDataModule` (``val_loss/<name>``), else none."""
        return getattr(getattr(self.trainer, "datamodule", None), "val_names", None) or []

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        parts = self._add_loss(self._val_sums, dataloader_idx, batch)
        names = self._val_names()
        self.log(f"val_loss/{names[dataloader_idx]}" if names else "val_loss", parts.lm_loss, prog_bar=True,
                 batch_size=batch["input_ids"].shape[0], sync_dist=True, add_dataloader_idx=False)

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}

    def on_validation_epoch_end(self) -> None:
        # Blocks are equally long and unpadded, so exp(mean loss) is each set's token perplexity.
        for name in self._val_names():
            loss = self.trainer.callback_metrics.get(f"val_loss/{name}")
            if loss is not None:
                self.log(f"val_ppl/{name}", torch.exp(loss), add_dataloader_idx=False)
        if self._val_sums and not self.trainer.sanity_checking and self.trainer.state.fn == "fit":
            mean = self._mean_validation_loss(self._val_sums)
            if len(self._val_sums) > 1:
                self.log("val_loss/mean", mean, add_dataloader_idx=False)
            self._candidate(mean)

    def _mean_validation_loss(self, sums: dict[int, list[float]]) -> float:
        """Mean over the validation sets of each set's mean per-block loss (summed over ranks)."""
        totals = torch.tensor([sums[i] for i in sorted(sums)], dtype=torch.float64, device=self.device)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        self._latest_set_losses = (totals[:, 0] / totals[:, 1]).tolist()
        return float((totals[:, 0] / totals[:, 1]).mean())

    def _candidate(self, mean: float) -> None:
        """Record the current state's mean validation loss; keep a copy of it if it is the best so far."""
        if not self.keep_best:
            return
        step = int(self.trainer.global_step)
        if self.validation_history and self.validation_history[-1][0] == step:
            return  # this state was already evaluated
        self.validation_history.append((step, mean))
        self._set_losses[step] = self._latest_set_losses
        if self._best is None or mean < self._best[1]:
            self._best = (step, mean, {name: value.detach().clone() for name, value in self.model.named_parameters()
                                       if value.requires_grad})

    @torch.no_grad()
    def _validate_now(self) -> None:
        """Evaluate the current state on the fit's validation loaders (outside Lightning's loop)."""
        loop = self.trainer.fit_loop.epoch_loop.val_loop
        if not loop._data_source.is_defined():
            return  # a fit without validation data: nothing to compare
        loop.setup_data()  # the loaders (and batch limits) Lightning's own validation uses
        if loop._combined_loader is None:
            return
        loaders, limits = loop._combined_loader.flattened, loop._max_batches
        sums: dict[int, list[float]] = {}
        with eval_mode(self.model):
            for index, (loader, limit) in enumerate(zip(loaders, limits)):
                for number, batch in enumerate(loader):
                    if number >= limit:  # may be inf
                        break
                    self._add_loss(sums, index, self.transfer_batch_to_device(batch, self.device, index))
        if sums:
            self._candidate(self._mean_validation_loss(sums))

    def on_train_start(self) -> None:
        self.validation_history, self._best, self._set_losses, self._trained_tokens = [], None, {}, 0
        if self.keep_best and self.trainer.limit_val_batches != 0:
            self._validate_now()  # the starting model is a candidate too

    def on_train_end(self) -> None:
        self._restore_best()
        self.finetune_record = self._record()
        add_finetune_record(self.hf_model.config, self.finetune_record)

    def _restore_best(self) -> None:
        """Restore the best validation state if the final one is worse (``keep_best``), with a warning."""
        if not self.keep_best or self._best is None:
            return
        if self.validation_history[-1][0] != self.trainer.global_step:
            self._validate_now()  # the final state, if the last validation came before it
        final_step, final = self.validation_history[-1]
        best_step, best, state = self._best
        if best_step == final_step:
            return
        unexpected = self.model.load_state_dict(state, strict=False).unexpected_keys  # the trainable parameters only
        if unexpected:  # renamed since they were kept: never report a restore that did not happen
            raise RuntimeError(f"FinetuneModule: the best validation state names parameters the model no longer has: "
                               f"{', '.join(unexpected)}.")
        where = "the starting model (before training)" if best_step == 0 else f"step {best_step}"
        rank_zero_warn(
            f"FinetuneModule: restored the best validation state, {where}: mean validation loss {best:.4f}; "
            f"the final state (step {final_step}) had {final:.4f}."
        )

    def _record(self) -> dict[str, Any]:
        """The fit as ``config.json`` and the model card record it: method, loss, optimizer, steps and tokens, data,
        and the recovery measured (each validation set's mean loss before -> after; perplexity for the equal-length
        blocks of a :class:`ompmoe.FinetuneDataModule`)."""
        tokens = torch.as_tensor(self._trained_tokens, dtype=torch.float64, device=self.device)
        record: dict[str, Any] = {"method": "lora" if self.lora_rank > 0 else "full"}
        if self.lora_rank > 0:
            alpha = self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_rank
            record["lora"] = {"rank": self.lora_rank, "alpha": float(alpha), "dropout": float(self.lora_dropout),
                              "modules": self._lora_targets[0], "expert_parameters": self._lora_targets[1]}
        if self.distills:
            teacher = self.teacher_name_or_path or getattr(getattr(self._teacher, "config", None), "_name_or_path",
                                                           None)
            record.update(teacher=str(teacher or f"a {type(self._teacher).__name__} instance"),
                          distill_weight=self.distill_weight)
        record.update(
            aux_loss_coef=self.aux_coef,
            optimizer={"name": "AdamW", "learning_rate": float(self.learning_rate),
                       "weight_decay": float(self.weight_decay), "warmup_steps": self.warmup_steps},
            steps=int(self.trainer.global_step),
            tokens=int(self.trainer.strategy.reduce(tokens, reduce_op="sum")),  # every rank's batches
            data=self._data_record(),
            validation=self._validation_record())
        return record

    def _data_record(self) -> dict[str, Any] | None:
        """The training text of a :class:`ompmoe.CalibrationDataModule` (source, blocks, batch), else ``None``."""
        data = getattr(self.trainer, "datamodule", None)
        if not isinstance(getattr(data, "source", None), str):
            return None
        return {"source": data.source, "data_files": list(getattr(data, "data_files", None) or []),
                **{key: getattr(data, key, None) for key in ("seq_len", "num_blocks", "batch_size")}}

    def _validation_record(self) -> dict[str, Any]:
        """Each validation set's mean loss at the start and in the saved state (the best one, if restored)."""
        if not self.keep_best:
            return {"not_measured": "keep_best=False validates no starting model to compare with"}
        if not self.validation_history or self._best is None:
            return {"not_measured": "no validation data"}
        (start, _), (final_step, final_mean) = self.validation_history[0], self.validation_history[-1]
        kept = self._best[0]  # the state _restore_best left in place (the final one unless it restored)
        before, after = self._set_losses[start], self._set_losses[kept]
        names = self._val_names()
        return {"sets": names or [f"validation set {index}" for index in range(len(before))],
                "loss_before": before, "loss_after": after, "perplexity": bool(names), "before_step": start,
                "kept_step": kept, "final_step": final_step, "final_mean": final_mean}

    def configure_callbacks(self) -> list[pl.Callback]:
        """:class:`ProgressLines` when stderr is not a terminal (a log file, CI) and the Trainer's progress bar is on:
        the bar shows nothing useful there (none at all under ``python -m ompmoe.lightning.finetune_module``)."""
        trainer = self._trainer
        if (trainer is None or trainer.progress_bar_callback is None or sys.stderr.isatty()
                or any(isinstance(callback, ProgressLines) for callback in trainer.callbacks)):
            return []
        return [ProgressLines()]

    def configure_optimizers(self) -> Any:
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        if not parameters:
            raise ValueError("FinetuneModule has no trainable parameters.")
        optimizer = torch.optim.AdamW(parameters, lr=self.learning_rate, weight_decay=self.weight_decay)
        if not self.warmup_steps:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / self.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def setup(self, stage: str) -> None:
        """Refuse an unusable ``save_dir`` (existing, or holding the model or data read) before training."""
        if stage == "fit" and self.save_dir is not None:
            self._inputs = inputs_of(self, getattr(self.trainer, "datamodule", None))
            check_writable(self.save_dir, self.overwrite, directory=True, inputs=self._inputs)

    def on_fit_end(self) -> None:
        if self.save_dir is None:
            return
        model = self.merged_model()
        if self.trainer.is_global_zero:
            # The data module's tokenizer, else save_pruned takes the source checkpoint's (or warns).
            tokenizer = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
            tokenizer = tokenizer if isinstance(tokenizer, str) and tokenizer != "bytes" else None
            save_pruned(model, self.save_dir, overwrite=self.overwrite, tokenizer=tokenizer,
                        inputs=getattr(self, "_inputs", ()))


def main(args: list[str] | None = None) -> None:
    """``python -m ompmoe.lightning.finetune_module fit ...``: LightningCLI of FinetuneModule + FinetuneDataModule
    (training blocks, and held-out validation per domain: ``--data.val_sources``)."""
    from lightning.pytorch.cli import LightningCLI

    from .finetune_data import FinetuneDataModule

    quiet_third_party()
    try:
        LightningCLI(FinetuneModule, FinetuneDataModule, save_config_kwargs={"overwrite": True}, args=args,
                     seed_everything_default=0)  # reproducible by default, as `ompmoe fit`'s configs
    except user_errors() as error:  # one line and exit status 2, as every ompmoe command
        fail(error)


if __name__ == "__main__":
    main()
