"""The Hugging Face hub as ompmoe meets it: whether offline mode is on, whether the hub answers (one probe), and hub
reads that go to the local cache alone where it does not answer. Without that the hub libraries retry each file
five times with back-off (about 23 s a file) before they fall back to the cache: minutes for a cached model and its
tokenizer on a machine without a network."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock  # torch imports it anyway

PROBE_TIMEOUT_S = 5.0  # one HEAD request to the hub, no retries
ANSWER_KEPT_S = 60.0  # a probe's outcome is kept this long: one probe for the several reads of one command
_ANSWERED: dict[str, tuple[bool, float]] = {}  # endpoint -> (answered, time.monotonic() of the probe)


def offline_mode(datasets: bool = True) -> bool:
    """Offline mode as the environment says *now* (or as the hub libraries read it at import); ``datasets=False``:
    the hub's own flag only (``HF_DATASETS_OFFLINE`` is about data sets)."""
    from huggingface_hub import constants  # a dependency of transformers

    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if datasets else ("HF_HUB_OFFLINE",)
    flags = (os.environ.get(var, "").upper() for var in names)
    return any(flag in ("1", "ON", "YES", "TRUE") for flag in flags) or bool(constants.HF_HUB_OFFLINE)


def hub_reachable() -> bool:
    """One HEAD request to the hub endpoint (proxies honoured), no retries; none while its last answer, or its
    silence, is recent (a network that drops the request costs the probe's timeout once, not at every read)."""
    from huggingface_hub import constants, get_session

    answered, when = _ANSWERED.get(constants.ENDPOINT, (False, -math.inf))
    if time.monotonic() - when < ANSWER_KEPT_S:
        return answered
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
        answered = True
    except Exception:  # any transport failure: DNS, refused, timeout, proxy
        answered = False
    _ANSWERED[constants.ENDPOINT] = (answered, time.monotonic())
    return answered


def is_hub_id(name: str | os.PathLike) -> bool:
    """Whether ``name`` reads as a hub repository id (``org/name``) and is no local path."""
    from huggingface_hub.utils import validate_repo_id

    if Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(str(name))
    except Exception:  # noqa: BLE001 - HFValidationError: a path that does not exist yet, not a hub id
        return False
    return True


@contextmanager
def cache_only_where_unreachable(name: str | os.PathLike) -> Iterator[None]:
    """Hub reads of ``name`` inside the block from the local cache alone when it is a hub id (not a local path) and
    the hub's offline mode is on or the hub does not answer; otherwise as the hub libraries read. What is not cached
    then fails at once, as it would after the retries."""
    if not is_hub_id(name) or (not offline_mode(datasets=False) and hub_reachable()):
        yield
        return
    from huggingface_hub import constants

    with mock.patch.object(constants, "HF_HUB_OFFLINE", True):
        yield


__all__ = ["cache_only_where_unreachable", "hub_reachable", "is_hub_id", "offline_mode"]
