"""lm-eval's notices that a user of ``ompmoe validate`` cannot act on, dropped at lm-eval's task logger.

Every task whose data comes from a ``custom_dataset`` function (the shipped HumanEval task, the
offline test tasks) makes lm-eval log, once per task, that custom kwargs "can be passed to
``--metadata`` in console" (lm-eval's own CLI, which ``ompmoe validate`` is not; here they are
``--data.metadata``). Only that message is dropped; every other lm-eval warning still shows.
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
