"""What "fails before any work" means in the offline tests, without a clock: no connection, no wait, one cache read.

A download that retries is slow because it opens connections and sleeps between attempts; reading only the local
cache does neither. :func:`guard_offline` records both (internet sockets are refused, ``time.sleep`` returns at
once) and every ``datasets.load_dataset`` call with the hub libraries' offline flags as they were during the call.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OfflineRecord:
    connections: list[Any] = field(default_factory=list)
    """Addresses of every internet connection attempted (each refused)."""
    sleeps: list[float] = field(default_factory=list)
    """Every ``time.sleep`` call (a retry loop's back-off), which returned at once."""
    loads: list[tuple[str, bool, bool]] = field(default_factory=list)
    """``(path, datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)`` per ``load_dataset``."""

    def assert_one_cache_only_read(self, path: str) -> None:
        """One ``load_dataset`` of ``path``, made with both offline flags on (cache only), and nothing else."""
        assert self.loads == [(path, True, True)], self.loads
        assert self.connections == [], self.connections
        assert self.sleeps == [], self.sleeps


def guard_offline(monkeypatch) -> OfflineRecord:
    import datasets
    import datasets.config
    from huggingface_hub import constants

    record = OfflineRecord()
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def refused(original):
        def attempt(self, address, *args, **kwargs):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                record.connections.append(address)
                raise ConnectionRefusedError(f"test: no network ({address!r})")
            return original(self, address, *args, **kwargs)
        return attempt

    monkeypatch.setattr(socket.socket, "connect", refused(connect))
    monkeypatch.setattr(socket.socket, "connect_ex", refused(connect_ex))
    monkeypatch.setattr(time, "sleep", record.sleeps.append)
    load_dataset = datasets.load_dataset

    def recorded_load_dataset(path, *args, **kwargs):
        record.loads.append((str(path), bool(datasets.config.HF_HUB_OFFLINE), bool(constants.HF_HUB_OFFLINE)))
        return load_dataset(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", recorded_load_dataset)
    return record
