"""Drops lm-eval's notice that ``custom_dataset`` kwargs "can be passed to ``--metadata``": that is
lm-eval's own CLI, not ``ompmoe validate`` (``--data.metadata``). Every other lm-eval warning still shows.
"""

from __future__ import annotations

import logging

METADATA_NOTICE = "Custom kwargs can be passed to `--metadata` in console"


def _not_the_metadata_notice(record: logging.LogRecord) -> bool:
    return METADATA_NOTICE not in str(record.msg)


def drop_metadata_notice() -> None:
    """Install the filter on lm-eval's task logger (once: ``addFilter`` skips a filter already there)."""
    logging.getLogger("lm_eval.api.task").addFilter(_not_the_metadata_notice)
