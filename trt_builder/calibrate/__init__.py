"""Calibration: the bundled corpus and activation statistics of the transformers model (the calibrate stage)."""

#: The handoff key of the model the calibration loaded (BuildContext.handoff): the recipe
#: search takes it.
MODEL_HANDOFF = "calibrate.model"
