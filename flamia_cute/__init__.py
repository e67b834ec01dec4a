"""flamia_cute: FP8 attention kernels for training on packed documents."""

import os

# The CuTe DSL fixes its target arch when cutlass is first imported: a GPU-less cross-compile
# (FLAMIA_ARCH=sm_90a) announces it before any kernel module imports cutlass.
if os.environ.get("FLAMIA_ARCH") and not os.environ.get("CUTE_DSL_ARCH"):
    os.environ["CUTE_DSL_ARCH"] = os.environ["FLAMIA_ARCH"]

from . import custom_ops  # noqa: F401  (the torch.library ops and their FlopCounterMode formulas, at import)
from .interface import flamia_attn_func, flamia_attn_varlen_func
from .recipes import DEFAULT_RECIPE, NAMED_RECIPES, OperandQuant, Recipe
from .rotary import Rotary, RotaryConfig, apply_rotary
from .version import __version__

__all__ = ["flamia_attn_func", "flamia_attn_varlen_func", "Recipe", "OperandQuant", "NAMED_RECIPES", "DEFAULT_RECIPE", "Rotary",
           "RotaryConfig", "apply_rotary", "__version__"]
