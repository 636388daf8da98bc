"""The error a calibration batch that cannot give correct statistics raises, wherever it is found: in the batch checks
before the forward (collector.py) or in the sums it would fill (sums.py)."""

from __future__ import annotations


class CalibrationInputError(ValueError):
    """A calibration batch cannot give correct statistics (empty, ids outside the vocabulary, bad mask)."""


__all__ = ["CalibrationInputError"]
