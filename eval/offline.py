"""Where lm-eval tasks read their data sets: the hub, its local cache, or local copies.

:func:`dataset_access` wraps lm-eval's loading while tasks are built: ``dataset_overrides`` (keys: a task, a data
set path or ``path:name``; values: a local directory, or ``dataset_path``/``dataset_name``/``dataset_kwargs``,
merged) and ``data_dir`` snapshots (``<data_dir>/<owner>/<name>``) replace the hub. Offline or with the hub silent,
a data set missing from the cache raises :class:`DatasetUnavailableError` at once, naming both ways to supply it.
Forms and examples: docs/evaluation.md, "Getting the data sets".
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from ..data.sources import HubUnavailableError, hub_offline
from ..engine.hub import hub_reachable, offline_mode

PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "imagefolder", "audiofolder"}


class DatasetUnavailableError(HubUnavailableError):
    """A task's data set is neither local nor downloadable (offline, or the hub is unreachable)."""


def _is_local(path: str | None) -> bool:
    return bool(path) and (path in PACKAGED_BUILDERS or os.path.exists(os.path.expanduser(path)))


class _Access:
    def __init__(self, data_dir: str | None, overrides: Mapping[str, Any] | None) -> None:
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        if self.data_dir is not None and not self.data_dir.is_dir():
            raise FileNotFoundError(f"data_dir {str(self.data_dir)!r} is not a directory.")
        self.overrides = dict(overrides or {})
        self.used: dict[str, str] = {}  # task -> where its data came from

    @functools.cached_property
    def offline_reason(self) -> str:
        """Why the hub cannot be used ("" when it can), probed once."""
        if offline_mode():
            return "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
        if not hub_reachable():
            return "the Hugging Face hub cannot be reached"
        return ""

    def resolve(self, task: str, path: str | None, name: str | None, kwargs: dict[str, Any]) -> tuple:
        override = next((self.overrides[key] for key in (task, f"{path}:{name}", path) if key in self.overrides), None)
        if isinstance(override, str):
            return str(Path(override).expanduser()), name, kwargs
        if isinstance(override, Mapping):
            extra = dict(override.get("dataset_kwargs") or {})
            return (override.get("dataset_path", path), override.get("dataset_name", name), {**kwargs, **extra})
        if override is not None:
            raise ValueError(f"dataset_overrides[{task!r}] must be a local path or a dict, got {override!r}.")
        if self.data_dir is not None and path and not _is_local(path) and (self.data_dir / path).is_dir():
            return str(self.data_dir / path), name, kwargs
        return path, name, kwargs


@contextmanager
def dataset_access(data_dir: str | None = None, overrides: Mapping[str, Any] | None = None) -> Iterator[_Access]:
    """Route lm-eval tasks' data set loading through local copies and the offline check (see module doc)."""
    from lm_eval.api.task import ConfigurableTask

    access = _Access(data_dir, overrides)
    original = ConfigurableTask.download

    def download(task_self: Any, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        config = task_self.config
        task = str(config.task)
        if callable(config.custom_dataset):
            access.used[task] = "custom_dataset"
            return original(task_self, dataset_kwargs, **kwargs)
        path, name, merged = access.resolve(task, task_self.DATASET_PATH, task_self.DATASET_NAME,
                                            dict(dataset_kwargs or {}))
        task_self.DATASET_PATH, task_self.DATASET_NAME = path, name
        local = _is_local(path)
        reason = "" if local else access.offline_reason
        if not reason:
            access.used[task] = str(path) if local else f"hub:{path}"
            return original(task_self, merged, **kwargs)
        try:
            with hub_offline():
                result = original(task_self, merged, **kwargs)
        except Exception as error:
            dataset = f"{path!r}" + (f" (config {name!r})" if name else "")
            raise DatasetUnavailableError(
                f"Task {task!r} needs the data set {dataset}, which is not in the local datasets cache, and it "
                f"cannot be downloaded: {reason}. Where there is internet, run `huggingface-cli download --repo-type "
                f"dataset {path} --local-dir <data_dir>/{path}` (or load it once to fill the cache), then pass "
                f"data_dir=<data_dir> (CLI: --data.data_dir), or point this task at a local copy with "
                f"dataset_overrides={{{task!r}: '/path/to/copy'}}."
            ) from error
        access.used[task] = f"cache:{path}"
        return result

    with mock.patch.object(ConfigurableTask, "download", download):
        yield access
