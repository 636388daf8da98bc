"""Data of the ``ompmoe_word_order`` task (built offline from the shipped corpus: :mod:`ompmoe.eval.word_order`)."""

from ompmoe.eval.word_order import dataset  # noqa: F401  (custom_dataset: !function ompmoe_word_order_utils.dataset)
