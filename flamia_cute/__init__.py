"""flamia_cute: FP8 attention kernels for training on packed documents."""

from .interface import flamia_attn_varlen_func
from .recipes import DEFAULT_RECIPE, NAMED_RECIPES, OperandQuant, Recipe

__version__ = "0.1.0"

__all__ = ["flamia_attn_varlen_func", "Recipe", "OperandQuant", "NAMED_RECIPES", "DEFAULT_RECIPE", "__version__"]
