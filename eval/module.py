"""``EvalModule``: runs an LMEvalDataModule's batches through a Hugging Face causal LM.

Forward-only: score batches get each continuation's float32 log-probability and greedy match, generate batches
``model.generate`` with lm-eval's stop sequences. Every batch is timed (:mod:`ompmoe.eval.cost`); at the epoch's end
a timing probe (:mod:`ompmoe.eval.timing`) runs, then rank 0 scores all ranks' results and writes the JSON.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from ..lightning.calibration_module import CalibrationModule
from ..lightning.models import model_config
from . import results as scoring
from .comparability import weights_fingerprint
from .cost import batch_item_costs, device_name
from .labels import model_label
from .requests import SCORE
from .timing import inputs_fingerprint, probe_indices, timing_record

__all__ = ["EvalModule"]


class EvalModule(CalibrationModule):
    """A Hugging Face causal LM (original or pruned) evaluated by :class:`ompmoe.eval.LMEvalDataModule`.

    Args:
        model: Hub id, local path (including ompmoe's pruned checkpoints), ``tiny:<model_type>``, or an instance.
        dtype: Weights dtype when loading (``bfloat16`` for the paper's models).
        tokenizer: Tokenizer id or path; defaults to ``model`` (``bytes`` for tiny models).
        trust_remote_code: Passed to ``from_pretrained``.
        label: Row label in reports (default: the model name with its recorded pruning plan).
        experts_implementation: transformers' experts implementation (``eager``, ``grouped_mm``, ...), recorded.
        timing_repeats: Timed passes of the timing probe after the loop (the report's Speedup and its interval;
            0: no probe, the speedup is then unrated).
        timing_batches: Batches in the timing probe, evenly spaced over this rank's length-sorted batches.
        timing_warmup: Untimed passes over the probe before the timed ones.
    """

    calibrates: ClassVar[bool] = False  # evaluates any causal LM, dense or pruned already

    def __init__(
        self,
        model: str | nn.Module = "tiny:qwen3_moe",
        dtype: str | None = None,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        label: str | None = None,
        experts_implementation: str | None = None,
        timing_repeats: int = 5,
        timing_batches: int = 8,
        timing_warmup: int = 1,
    ) -> None:
        super().__init__(model=model, dtype=dtype, tokenizer=tokenizer, trust_remote_code=trust_remote_code)
        for name, value in (("timing_repeats", timing_repeats), ("timing_batches", timing_batches),
                            ("timing_warmup", timing_warmup)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}.")
        self.label = label
        self.experts_implementation = experts_implementation
        self.timing_repeats, self.timing_batches, self.timing_warmup = timing_repeats, timing_batches, timing_warmup
        self._probe: list[Mapping[str, Any]] = []  # this epoch's probe batches (already on the device)
        self._probe_at: set[int] = set()
        self._costs: dict[int, tuple[float, float]] = {}
        self._loop_start = self._loop_cpu = 0.0
        self._tokenizer: Any = None
        self._results: dict[int, Any] = {}
        self.eval_results: dict[str, Any] | None = None  # rank 0: lm-eval's results of the last epoch
        self.eval_metrics: dict[str, float] = {}  # every rank: the logged metrics

    def configure_model(self) -> None:
        super().configure_model()
        if self.experts_implementation is not None:
            self.model.set_experts_implementation(self.experts_implementation)

    def get_tokenizer(self) -> Any:
        """The tokenizer named by ``tokenizer`` (loaded once)."""
        if self._tokenizer is None:
            from .tokenization import BYTES, load_tokenizer

            name = self.tokenizer_name
            files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
            if name is None or (isinstance(name, str) and os.path.isdir(name)
                                and not any(os.path.exists(os.path.join(name, file)) for file in files)):
                # Tiny models (instances, or pruned and saved by ompmoe) have no tokenizer: their vocabulary is bytes.
                if getattr(self.model_config(), "vocab_size", None) == 256:
                    name = BYTES
            if name is None:
                raise ValueError(
                    "EvalModule needs tokenizer=... (a hub id or path) for a model instance without a name.")
            self._tokenizer = load_tokenizer(name, trust_remote_code=self.trust_remote_code)
        return self._tokenizer

    def model_config(self) -> Any:
        """The model's config without loading weights (for the context length)."""
        if self.model is not None:
            return self.model.config
        name = self.model_name_or_path
        return None if name is None else model_config(name, self.trust_remote_code)

    def model_info(self) -> dict[str, Any]:
        """The model as the results file records it (``ompmoe.model``)."""
        from ..engine.apply.adaptive import adaptive_info
        from ..engine.apply.pruning import pruning_info

        name = self.model_name_or_path or type(self.model).__name__
        info: dict[str, Any] = {"model": name}
        record = pruning_info(self.model) if self.model is not None else None
        if record:
            original, kept = record.get("original_num_experts", {}), record.get("kept_experts", {})
            per_layer = [len(kept.get(layer, range(int(n)))) for layer, n in original.items()]
            total = sum(int(v) for v in original.values())
            info["pruning"] = {"experts": total, "kept_experts": sum(per_layer),
                               "removed_fraction": 1 - sum(per_layer) / total if total else 0.0,
                               "kept_per_layer": per_layer}
            if record.get("plan"):
                info["plan"] = dict(record["plan"])  # method, ratio, allocation, calibration tokens, model id
        adaptive = adaptive_info(self.model) if self.model is not None else None
        if adaptive:
            info["adaptive"] = {key: adaptive[key] for key in ("epsilon", "zeta") if key in adaptive}
        # Identity of the base model, for honest comparisons (ompmoe report): pruning keeps the embeddings.
        info["base_model"] = (record.get("plan") or {}).get("model_id") if record else name
        info["weights_fingerprint"] = weights_fingerprint(self.model) if self.model is not None else None
        with contextlib.suppress(StopIteration, AttributeError):
            info["dtype"] = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        info["experts_implementation"] = getattr(getattr(self.model, "config", None), "_experts_implementation", None)
        info["label"] = self.label or model_label(info)
        return info

    def on_validation_epoch_start(self) -> None:
        self._results, self._costs, self._probe = {}, {}, []
        counts = (self.trainer.num_test_batches if self.trainer.testing else self.trainer.num_val_batches) or [0]
        total = int(counts[0]) if math.isfinite(counts[0]) else 0
        self._probe_at = set(probe_indices(total, self.timing_batches if self.timing_repeats else 0))
        self._loop_start, self._loop_cpu = time.perf_counter(), time.process_time()

    on_test_epoch_start = on_validation_epoch_start

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
        """Run one batch and record its items' share of its wall time and tokens."""
        start = time.perf_counter()
        outputs = self.run_batch(batch)  # ends with a copy to the host: the device work is done
        self._results.update(outputs)
        self._costs.update(batch_item_costs(batch, outputs, time.perf_counter() - start))
        if batch_idx in self._probe_at:
            self._probe.append(batch)

    test_step = validation_step

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._finish("validate")

    def on_test_epoch_end(self) -> None:
        self._finish("test")

    @torch.no_grad()
    def run_batch(self, batch: Mapping[str, Any]) -> dict[int, Any]:
        """``{item id: result}`` of one batch: ``(logprob, is_greedy)`` or the generated token ids."""
        return self._score(batch) if batch["kind"] == SCORE else self._generate(batch)

    @functools.cached_property
    def _accepts_logits_to_keep(self) -> bool:
        try:
            return "logits_to_keep" in inspect.signature(self.model.forward).parameters
        except (TypeError, ValueError):
            return False

    def _score(self, batch: Mapping[str, Any]) -> dict[int, Any]:
        input_ids, lengths = batch["input_ids"], batch["lengths"]
        rows, tokens, counts = batch["target_rows"], batch["target_tokens"], batch["target_lengths"]
        width = input_ids.shape[1]
        starts = lengths[rows] - counts  # first logit position that predicts a continuation token
        kwargs: dict[str, Any] = {}
        if self._accepts_logits_to_keep:
            kwargs["logits_to_keep"] = int(width - starts.min())  # lm_head only where continuations are scored
        # Right padding and no attention mask, as HFLM: causal attention keeps padding out of every scored position.
        logits = self.model(input_ids=input_ids, use_cache=False, **kwargs).logits
        offset = width - logits.shape[1]
        logprobs, greedy, order = [], [], []
        for row in torch.unique(rows).tolist():
            row_lp = torch.log_softmax(logits[row].float(), dim=-1)
            row_argmax = row_lp.argmax(dim=-1)
            for target in (rows == row).nonzero().flatten().tolist():
                start, count = int(starts[target]) - offset, int(counts[target])
                wanted = tokens[target, :count]
                picked = row_lp[start:start + count].gather(-1, wanted[:, None]).squeeze(-1)
                logprobs.append(picked.sum())
                greedy.append((row_argmax[start:start + count] == wanted).all())
                order.append(target)
        return dict(zip(batch["target_items"][order].tolist(),
                        zip(torch.stack(logprobs).tolist(), torch.stack(greedy).tolist())))

    def _generate(self, batch: Mapping[str, Any]) -> dict[int, Any]:
        from lm_eval.models.utils_hf import stop_sequences_criteria

        tokenizer = self._data().tokenizer_
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        width = input_ids.shape[1]
        kwargs = dict(batch["generate_kwargs"])
        if self.device_mesh is not None and self.trainer is not None and self.trainer.world_size > 1:
            kwargs["synced_gpus"] = True  # sharded weights: every rank steps until all are done
        stopping = stop_sequences_criteria(tokenizer, list(batch["until"]), width, input_ids.shape[0])
        output = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_length=width + int(batch["max_gen_toks"]),
            stopping_criteria=stopping, pad_token_id=tokenizer.pad_token_id, use_cache=True, **kwargs,
        )
        return dict(zip(batch["items"].tolist(), output[:, width:].tolist()))

    def _data(self) -> Any:
        from .datamodule import LMEvalDataModule

        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if not isinstance(datamodule, LMEvalDataModule):
            raise TypeError(
                "EvalModule needs an ompmoe.eval.LMEvalDataModule: trainer.validate(module, datamodule=...).")
        return datamodule

    def _finish(self, stage: str) -> None:
        datamodule = self._data()
        seconds, cpu_seconds = time.perf_counter() - self._loop_start, time.process_time() - self._loop_cpu
        distributed = (self.trainer.world_size > 1 and torch.distributed.is_available()
                       and torch.distributed.is_initialized())
        mine = (self._results, self._costs, seconds, cpu_seconds, self._time_probe(distributed))
        self._probe = []
        gathered: list[Any] = [mine]  # per rank
        if distributed:
            gathered = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, mine)
        results = {key: value for part, *_ in gathered for key, value in part.items()}
        costs = {key: value for _, part, *_ in gathered for key, value in part.items()}
        seconds = max(part[2] for part in gathered)  # the ranks run at once: the slowest one's time
        cpu_seconds = sum(part[3] for part in gathered)
        probes = [part[4] for part in gathered]
        payload: Any = None
        if self.trainer.is_global_zero:
            try:
                run = {"seconds": seconds, "items": costs, "cpu_seconds": cpu_seconds,
                       "device": device_name(self.device), "threads": torch.get_num_threads(),
                       "ranks": self.trainer.world_size}
                timing = _merge_probes(probes, self.timing_warmup)
                if timing is not None:
                    run["timing"] = timing
                scored = datamodule.score(results, model_info={**self.model_info(), "stage": stage}, cost=run)
                scoring.write(datamodule, scored)
                self.eval_results = scored
                payload = scoring.flat_metrics(scored)
            except Exception as error:  # let the other ranks fail too instead of waiting forever
                payload = error
                if not distributed:
                    raise
        if distributed:
            payload = self.trainer.strategy.broadcast(payload, src=0)
        if isinstance(payload, Exception):
            raise RuntimeError(f"Scoring on rank 0 failed: {payload!r}") from payload
        self.eval_metrics = dict(payload)
        for name, value in self.eval_metrics.items():
            # Every rank logs rank 0's values; "max" of equal values keeps them exact (and Lightning quiet).
            self.log(name, value, sync_dist=distributed, reduce_fx="max")

    def _time_probe(self, distributed: bool) -> dict[str, Any] | None:
        """This rank's timing probe (wall and process CPU time per timed pass); ``None`` without a probe."""
        batches = self._probe
        if not (self.timing_repeats and batches):
            return None
        tokens = 0
        wall: list[float] = []
        cpu: list[float] = []
        # The probe must not move any random state the scoring or a later epoch sees (sampling tasks).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            for repeat in range(self.timing_warmup + self.timing_repeats):
                if distributed:
                    self.trainer.strategy.barrier()  # every rank starts each pass together
                start, start_cpu = time.perf_counter(), time.process_time()
                for batch in batches:
                    outputs = self.run_batch(batch)  # ends with a copy to the host: the device work is done
                    if repeat == 0:
                        tokens += sum(count for _, count in batch_item_costs(batch, outputs, 0.0).values())
                if repeat >= self.timing_warmup:
                    wall.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - start_cpu)
        return {"seconds": wall, "cpu_seconds": cpu, "batches": len(batches), "tokens": tokens,
                "inputs": inputs_fingerprint(batches)}


def _merge_probes(probes: list[dict[str, Any] | None], warmup: int) -> dict[str, Any] | None:
    """All ranks' probes as one ``ompmoe.cost.timing`` record: per pass the slowest rank's wall time and the
    ranks' summed CPU time (the ranks run at once, as in the loop); ``None`` without a probe."""
    probes = [probe for probe in probes if probe is not None]
    if not probes:
        return None
    wall = [max(times) for times in zip(*(probe["seconds"] for probe in probes))]  # zip: the fewest repeats
    cpu = [sum(times) for times in zip(*(probe["cpu_seconds"] for probe in probes))]
    return timing_record(wall, cpu, warmup=warmup, batches=sum(probe["batches"] for probe in probes),
                         tokens=round(sum(probe["tokens"] for probe in probes)),
                         inputs="+".join(probe["inputs"] for probe in probes))
