"""The block scales NVFP4's search may give a block (modes/nvfp4/recipe/scales.py chooses,
convert checks a recipe by them): the e4m3 value convert rounds absmax / (6 s2) to, the one
above it, and the seven below, walking the e4m3 grid (a positive e4m3 value's code plus or
minus one is its neighbour): from about 0.6x to 1.1x the amax scale, as AWQ's auto_clip grid
spans 0.55x to 1x, on the grid the format can hold. A smaller scale clips the block's largest
value (to 6) and rounds the others finer; the larger one gives a block whose amax rounded down
its headroom back. An all-zero block keeps scale 1.
"""

from __future__ import annotations

import torch

#: Steps on the e4m3 grid from the rounded amax scale: one up, seven down.
STEPS = (1, 0, -1, -2, -3, -4, -5, -6, -7)
#: The codes of e4m3's least and greatest positive finite values (2^-9 and 448).
_LEAST, _GREATEST = 0x01, 0x7E


def candidates(nearest: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [len(STEPS), *nearest.shape]: each block's candidate scales, STEPS[i]
    codes from `nearest` (block_scales'), clamped to the positive finite range."""
    code = nearest.view(torch.uint8).to(torch.int16)
    steps = torch.tensor(STEPS, dtype=torch.int16, device=code.device)
    moved = (code[None] + steps.reshape(-1, *[1] * code.dim())).clamp(_LEAST, _GREATEST)
    return moved.to(torch.uint8).view(torch.float8_e4m3fn)


def is_candidate(scales: torch.Tensor, nearest: torch.Tensor) -> torch.Tensor:
    """Whether each of `scales` is one of its block's candidates (bool, nearest's shape)."""
    return (candidates(nearest).view(torch.uint8) == scales.view(torch.uint8)[None]).any(0)
