"""The engine, folder by folder in the order a run goes: ``collect/`` (statistics) -> ``planning/`` (which experts to
keep) -> ``apply/`` (prune, compensate, adaptive inference) -> ``export/`` (checkpoint, card, plots), driven by
``run.py``. ``methods/`` holds the selection methods and their statistics, which plug into the registries of
``collect/`` and ``planning/``; the modules beside the folders are the ground every stage stands on.

Depends on torch, transformers, safetensors and torchmetrics only — never on Lightning or on the
recipes (:mod:`ompmoe.lightning`, :mod:`ompmoe.recipes`), which build on it.
"""
