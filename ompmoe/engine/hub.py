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
ANSWER_KEPT_S = 60.0  # a hub that answered is taken as reachable this long: one probe for a name checked twice
_ANSWERED: dict[str, float] = {}  # endpoint -> time.monotonic() of its last answer


def offline_mode() -> bool:
    """Offline mode as the environment says *now* (or as the hub libraries read it at import)."""
    from huggingface_hub import constants  # a dependency of transformers

    flags = (os.environ.get(var, "").upper() for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(flag in ("1", "ON", "YES", "TRUE") for flag in flags) or bool(constants.HF_HUB_OFFLINE)


def hub_reachable() -> bool:
    """One HEAD request to the hub endpoint (proxies honoured), no retries; none while its last answer is recent."""
    from huggingface_hub import constants, get_session

    if time.monotonic() - _ANSWERED.get(constants.ENDPOINT, -math.inf) < ANSWER_KEPT_S:
        return True
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception:  # any transport failure: DNS, refused, timeout, proxy
        return False
    _ANSWERED[constants.ENDPOINT] = time.monotonic()
    return True


@contextmanager
def cache_only_where_unreachable(name: str | os.PathLike) -> Iterator[None]:
    """Hub reads of ``name`` inside the block from the local cache alone when it is a hub id (not a local path) and
    offline mode is on or the hub does not answer; otherwise as the hub libraries read. What is not cached then fails
    at once, as it would after the retries."""
    if Path(name).expanduser().exists() or (not offline_mode() and hub_reachable()):
        yield
        return
    from huggingface_hub import constants

    with mock.patch.object(constants, "HF_HUB_OFFLINE", True):
        yield


__all__ = ["cache_only_where_unreachable", "hub_reachable", "offline_mode"]
