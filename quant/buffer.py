"""One allocation for every output of a quantization launch: the byte plan and the views.

The fused kernel writes Q, K, V (each: data_td, data_dt, scale, per set) into views of ONE
uint8 buffer. The plan depends only on shapes, so the custom op's fake implementation and its
backward rebuild the same views from the buffer alone (the op returns the buffer, not the
views: outputs of a custom op must not alias each other).
"""

from __future__ import annotations

import torch

BUFFER_ALIGN = 512  # byte alignment of every output inside the buffer (what torch's allocator gives)


def output_buffer_plan(T: int, Tdt: int, parts) -> tuple[list, int]:
    """parts: (num_heads, head_dim, num_sets, emit_transposed[, emit_token_major=True]) per tensor.
    Returns the plan, [part][set] = [(kind, shape, stride, byte offset) or None for data_td,
    data_dt, scale], and the buffer's byte size."""
    off = 0
    plan = []
    for H, D, num_sets, transposed, *rest in parts:
        token_major = rest[0] if rest else True
        part = []
        for _ in range(num_sets):
            entries = [("f8", (T, H, D), (H * D, D, 1), T * H * D) if token_major else None,
                       ("f8", (H, D, Tdt), (D * Tdt, Tdt, 1), H * D * Tdt) if transposed else None,
                       ("f32", (H, T), (T, 1), 4 * H * T)]
            st = []
            for e in entries:
                if e is None:
                    st.append(None)
                    continue
                st.append((e[0], e[1], e[2], off))
                off += -(-e[3] // BUFFER_ALIGN) * BUFFER_ALIGN
            part.append(st)
        plan.append(part)
    return plan, max(off, BUFFER_ALIGN)


def output_views(buf: torch.Tensor, plan) -> list:
    """[part][set] = (data_td, data_dt or None, scale) views of the uint8 buffer `buf`."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"buf must be a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    f8 = buf.view(torch.float8_e4m3fn)
    f32 = buf.view(torch.float32)
    sets = []
    for part in plan:
        ps = []
        for st in part:
            views = []
            for e in st:
                if e is None:
                    views.append(None)
                elif e[0] == "f8":
                    views.append(f8.as_strided(e[1], e[2], e[3]))
                else:
                    views.append(f32.as_strided(e[1], e[2], e[3] // 4))
            ps.append(tuple(views))
        sets.append(ps)
    return sets
