"""recipe: the INT8 recipe search (stage 3), between calibrate and convert."""
