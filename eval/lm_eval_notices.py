"""Drops lm-eval's notice that ``custom_dataset`` kwargs "can be passed to ``--metadata``": that is
lm-eval's own CLI, not ``ompmoe validate`` (``--data.metadata``). Every other lm-eval warning still shows.
"""

from __future__ import annotations

import logging

TASK_LOGGER = "lm_eval.api.task"
METADATA_NOTICE = "Custom kwargs can be passed to `--metadata` in console"


class DropMetadataNotice(logging.Filter):
    """Drops lm-eval's ``--metadata`` notice about ``custom_dataset`` tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return METADATA_NOTICE not in str(record.msg)


def drop_metadata_notice() -> None:
    """Install :class:`DropMetadataNotice` on lm-eval's task logger (once)."""
    logger = logging.getLogger(TASK_LOGGER)
    if not any(isinstance(f, DropMetadataNotice) for f in logger.filters):
        logger.addFilter(DropMetadataNotice())


__all__ = ["METADATA_NOTICE", "DropMetadataNotice", "drop_metadata_notice"]
