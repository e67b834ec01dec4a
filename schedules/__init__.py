"""Tile scheduling for packed variable-length documents (installed as flamia_cute.schedules)."""

from .ordering import lpt_order, simulate
from .varlen_chunks import build_varlen_chunks, max_chunks
from .varlen_tiles import causal_flops, enumerate_tiles

__all__ = ["build_varlen_chunks", "max_chunks", "causal_flops", "enumerate_tiles", "lpt_order", "simulate"]
