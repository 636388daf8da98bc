"""Lightning pieces: the calibration and fine-tuning LightningModules, the calibration data module, and
:class:`~ompmoe.lightning.fabric.FabricCalibration` for Lightning Fabric loops.

The callbacks live in :mod:`ompmoe.callbacks`. The engine imports nothing from here; ``models.py`` (model names) and
``finetune_loss.py`` (the losses) import no Lightning either.
"""
