"""Calibration: the bundled corpus and activation statistics of the transformers model (the calibrate stage)."""
