"""Progress bars (tqdm, on stderr) for the steps that take more than a few seconds.

``enabled=None`` shows a bar only when stderr is a terminal, so logs and pipes stay clean; ``True`` always, ``False``
never (``--quiet``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], description: str, enabled: bool | None = None, total: int | None = None,
             unit: str = "step") -> Iterator[T]:
    """``items`` with a progress bar named ``description`` (see the module docstring for ``enabled``)."""
    if enabled is False:
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, desc=description, total=total, unit=unit, disable=None if enabled is None else False,
                    leave=False)


__all__ = ["progress"]
