"""e4m3 values to bf16 on Hopper (sm_90a), in the CuTe DSL.

The bf16-dS backward's dK operand is Q in bf16: its e4m3 codes times its per-token power-of-two
scale (exact: bf16 holds every e4m3 value, and its products with powers of two in range). The
kernel loads them by TMA from this bf16 copy: faster than converting each query tile in shared
memory once per key block. This makes the copy in one pass at memory speed: 16 bytes of codes in,
32 bytes out per thread (about a third of torch's `.to(torch.bfloat16)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Uint32

from ..compile_cache import compile_entry, launch_on_device
from ..validation import check_kernel_tensors
from .primitives import ARG_BF16, ARG_F8, ARG_F32, SHARED_SOURCE_FILES, e4m3x2_to_bf16x2

SOURCE_FILES = (Path(__file__).resolve(), *SHARED_SOURCE_FILES)
CHUNK = 16  # bytes of codes per thread (one 128-bit load, two 128-bit stores)


@dataclass(frozen=True)
class CodesConfig:
    """Compile-time shape of the conversion: threads per CTA (the element count is dynamic), and
    whether each (token, head) row of a THD tensor is multiplied by its scale[head, token]."""

    threads: int = 256
    row_scale: bool = False

    def __post_init__(self):
        if self.threads not in (128, 256, 512, 1024):
            raise ValueError(f"CodesConfig.threads: must be 128, 256, 512 or 1024 (got {self.threads!r})")
        if not isinstance(self.row_scale, bool):
            raise ValueError(f"CodesConfig.row_scale: must be a bool (got {self.row_scale!r})")


def smem_bytes(config: CodesConfig) -> int:
    """No shared memory: registers only."""
    return 0


class E4m3CodesToBf16Sm90:
    def __init__(self, config: CodesConfig):
        self.cfg = config

    @cute.jit
    def __call__(self, src_ptr: cute.Pointer, scale_ptr: cute.Pointer, dst_ptr: cute.Pointer, n_chunks: Int32,
                 chunks_per_row: Int32, heads: Int32, tokens: Int32, stream: cuda.CUstream):
        """n_chunks 16-byte chunks; with row_scale, rows of chunks_per_row chunks, (token, head) row
        r = token * heads + head scaled by scale[head * tokens + token] ((H, T) fp32)."""
        words = CHUNK // 4
        scale = cute.make_tensor(scale_ptr, cute.make_layout(heads * tokens))
        src = cute.make_tensor(cute.recast_ptr(src_ptr, dtype=Uint32), cute.make_layout((words, n_chunks),
                                                                                         stride=(1, words)))
        dst = cute.make_tensor(cute.recast_ptr(dst_ptr, dtype=Uint32), cute.make_layout((2 * words, n_chunks),
                                                                                         stride=(1, 2 * words)))
        t = self.cfg.threads
        self.kernel(src, scale, dst, n_chunks, chunks_per_row, heads, tokens).launch(
            grid=[(n_chunks + t - 1) // t, 1, 1], block=[t, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, scale: cute.Tensor, dst: cute.Tensor, n_chunks: Int32, chunks_per_row: Int32,
               heads: Int32, tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.cfg.threads + tidx
        if i < n_chunks:
            words = CHUNK // 4
            codes = cute.make_rmem_tensor(cute.make_layout(words), Uint32)
            cute.autovec_copy(src[None, i], codes)
            out = cute.make_rmem_tensor(cute.make_layout(2 * words), Uint32)
            s = None
            if cutlass.const_expr(self.cfg.row_scale):
                row = i // chunks_per_row
                token = row // heads
                # a NaN scale (a non-finite input's block) gives zeros: this copy is an MMA operand,
                # where a NaN would meet masked zeros of other documents (max drops the NaN)
                s = cute.arch.fmax(scale[(row - token * heads) * tokens + token], Float32(0.0))
            for w in cutlass.range_constexpr(words):
                out[2 * w] = e4m3x2_to_bf16x2(codes[w], False, s)
                out[2 * w + 1] = e4m3x2_to_bf16x2(codes[w], True, s)
            cute.autovec_copy(out, dst[None, i])


ARG_KINDS = (ARG_F8, ARG_F32, ARG_BF16, ("i32",), ("i32",), ("i32",), ("i32",), ("stream",))


def compile_codes_sm90(config: CodesConfig, arch: str = "sm_90a", extra_options: str = "", tvm_ffi: bool = False):
    """cute.compile the conversion for `arch` from plain values only (no tensors, no GPU needed)."""
    return compile_entry(E4m3CodesToBf16Sm90(config), ARG_KINDS, arch, extra_options, tvm_ffi)


def kernel_artifacts(config: CodesConfig, arch: str = "sm_90a"):
    from ..compile_cache import compile_artifacts

    return compile_artifacts(compile_codes_sm90, config, arch)


def e4m3_codes_to_bf16(codes: torch.Tensor, scale: torch.Tensor | None = None,
                       config: CodesConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 copy of an e4m3 tensor's values (same shape), on its device's current stream: one launch.
    `codes` must be a contiguous float8_e4m3fn CUDA tensor, 16-byte aligned, of a multiple of 16
    elements (every THD operand at head dim 64 or 128 is). scale: (H, T) fp32 for THD codes
    (T, H, D) with D a multiple of 16: each (token, head) row times its scale (exact when the scales
    are powers of two, as the recipes' are: quant.formats.pow2_scale_from_amax), a row with a NaN
    scale as zeros (a non-finite input's block: its codes are 0 too). out: a contiguous
    bf16 tensor of codes' shape on its device to write (allocated here when None)."""
    from ..compile_cache import compile_launcher, target_arch

    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes must be a float8_e4m3fn tensor, got {getattr(codes, 'dtype', type(codes))}")
    if codes.device.type != "cuda" or not codes.is_contiguous() or codes.data_ptr() % 16:
        raise ValueError("codes must be a contiguous, 16-byte aligned CUDA tensor")
    if codes.numel() % CHUNK:
        raise ValueError(f"codes must hold a multiple of {CHUNK} elements, got {codes.numel()}")
    tokens = heads = per_row = 1
    if scale is not None:
        if codes.dim() != 3 or codes.shape[2] % CHUNK:
            raise ValueError(f"codes must be (T, H, D) with D a multiple of {CHUNK} to take a scale, got "
                             f"{tuple(codes.shape)}")
        tokens, heads, per_row = codes.shape[0], codes.shape[1], codes.shape[2] // CHUNK
        check_kernel_tensors((("scale", scale, (heads, tokens), torch.float32),), codes.device)
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.bfloat16, device=codes.device)
    else:
        check_kernel_tensors((("out", out, tuple(codes.shape), torch.bfloat16),), codes.device)
    if codes.numel():
        cfg = config or CodesConfig(row_scale=scale is not None)
        if cfg.row_scale != (scale is not None):
            raise ValueError(f"config.row_scale={cfg.row_scale} but scale is {'given' if scale is not None else 'None'}")
        launch = compile_launcher(SOURCE_FILES, cfg, target_arch(),
                                  lambda c, a, t: compile_codes_sm90(c, a, tvm_ffi=t), ARG_KINDS, None)
        launch_on_device(launch, codes.device, codes.data_ptr(), scale.data_ptr() if scale is not None else 0,
                         out.data_ptr(), codes.numel() // CHUNK, per_row, heads, tokens)
    return out
