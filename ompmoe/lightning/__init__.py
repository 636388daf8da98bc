"""Lightning pieces: the calibration and fine-tuning LightningModules, the calibration data module, and
:class:`~ompmoe.lightning.fabric.FabricCalibration` for Lightning Fabric loops.

The callbacks live in :mod:`ompmoe.callbacks`; everything here imports Lightning, the engine does not.
"""
