"""Lightning pieces: the calibration and fine-tuning LightningModules and the calibration data module.

The callbacks live in :mod:`ompmoe.callbacks`; everything here imports Lightning, the engine does not.
"""
