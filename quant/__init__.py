"""Scale layouts and quantization (installed as flamia_cute.quant)."""

from .buffer import BUFFER_ALIGN, output_buffer_plan, output_views
from .formats import BF16, E2M1, E4M3, E5M2, FloatFormat, cast_to, format_by_name, pow2_scale
from .quantize import (
    DT_DOC_ALIGN,
    PV_ORDER16,
    TOKEN_PAD,
    QuantizedTHD,
    dt_cu_seqlens,
    natural_dt,
    quantize_attention_operands,
    quantize_per_tensor,
    quantize_thd,
    quantize_thd_per_tensor,
    round_up,
    tensor_scale,
    token_block_ids,
    transposed_tokens,
)

__all__ = [
    "BUFFER_ALIGN", "output_buffer_plan", "output_views",
    "BF16", "E2M1", "E4M3", "E5M2", "FloatFormat", "cast_to", "format_by_name", "pow2_scale",
    "DT_DOC_ALIGN", "PV_ORDER16", "TOKEN_PAD", "dt_cu_seqlens", "transposed_tokens", "QuantizedTHD",
    "natural_dt", "quantize_attention_operands", "quantize_per_tensor", "quantize_thd",
    "quantize_thd_per_tensor", "round_up", "tensor_scale", "token_block_ids",
]

from .microscaling import mx_quantize, mx_quantize_2d, nvfp4_quantize  # noqa: E402

__all__ += ["mx_quantize", "mx_quantize_2d", "nvfp4_quantize"]

from .mx_layout import (  # noqa: E402
    MxDoOperands,
    MxForwardOperands,
    pack_mx_do_operands,
    pack_mx_forward_operands,
    sf_slots,
    sf_tile_starts,
)

__all__ += ["MxDoOperands", "MxForwardOperands", "pack_mx_do_operands", "pack_mx_forward_operands", "sf_slots",
            "sf_tile_starts"]
