"""The engine: statistics, selection, allocation, pruning, checkpoints and adaptive inference.

Depends on torch, transformers, safetensors and torchmetrics only — never on Lightning or on the
recipes (:mod:`ompmoe.lightning`, :mod:`ompmoe.recipes`), which build on it.
"""
