"""Input checks with errors that name the offending argument."""

from __future__ import annotations

import math
import numbers
import os

import torch

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    """Types, shapes, devices and dtypes: what needs no read of cu_seqlens' values (check_cu_seqlens_values,
    run where the call runs: this runs while torch.compile traces)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape (total_tokens, heads, head_dim), got rank {t.dim()}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be bfloat16 or float16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    d = q.shape[2]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q head_dim {d} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if k.shape[2] != d or v.shape[2] != d:
        raise ValueError(f"k and v head_dim must equal q's ({d}), got k {k.shape[2]}, v {v.shape[2]}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same (tokens, heads), got {tuple(k.shape[:2])} and {tuple(v.shape[:2])}")
    hq, hk = q.shape[1], k.shape[1]
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hk}) for GQA")
    _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    _check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], k.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
            f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    for name, mx in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        # numpy's integers too (numbers.Integral): the caller converts them to int
        if not isinstance(mx, (numbers.Integral, torch.SymInt)) or isinstance(mx, bool) or mx < 0:
            raise ValueError(f"{name} must be a non-negative int, got {mx!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
                                          and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number or None, got {softmax_scale!r}")


# cu_seqlens already checked, by (data pointer, version counter, numel, total): a training step
# reuses one cu_seqlens for every layer, so the host copy of a GPU tensor happens once per batch.
_CHECKED: dict[tuple, None] = {}
_CHECKED_MAX = 64


def has_no_values(t: torch.Tensor) -> bool:
    """A fake, functional or meta tensor (FakeTensorMode, tracing): its values cannot be read."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor)) or t.device.type == "meta"


def _check_cu(name, cu, total, device):
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (num_docs + 1), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device}, got {cu.device}")


def check_cu_seqlens_values(name, cu, total, mx_name, max_seqlen):
    """Values of cu_seqlens: starts at 0, non-decreasing, ends at the token count, longest <= max_seqlen.

    A GPU tensor is copied to the host once per (address, version, shape, total, max_seqlen): a
    training step reuses one cu_seqlens for every layer, so this costs one small sync per batch.
    FLAMIA_CUTE_TRUST_CU_SEQLENS=1 skips the check of GPU tensors altogether.
    """
    on_gpu = cu.device.type != "cpu"
    memo = (cu.data_ptr(), cu._version, cu.numel(), total, max_seqlen, str(cu.device))
    if on_gpu and (memo in _CHECKED or os.environ.get("FLAMIA_CUTE_TRUST_CU_SEQLENS") == "1"):
        return
    host = cu.cpu()
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    if bool((host[1:] < host[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if int(host[-1]) != total:
        raise ValueError(f"{name} must end at the token count {total}, got {int(host[-1])}")
    longest = int((host[1:] - host[:-1]).max())
    if longest > max_seqlen:
        raise ValueError(f"{mx_name} ({max_seqlen}) is smaller than the longest document ({longest})")
    if on_gpu:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[memo] = None


def int32_cu_seqlens(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """cu_seqlens as the kernels read it (int32, contiguous, on `device`): itself when it already is,
    as it is from the public API (a no-op .to() still costs host time on every launch)."""
    if cu_seqlens.dtype == torch.int32 and cu_seqlens.device == device and cu_seqlens.is_contiguous():
        return cu_seqlens
    return cu_seqlens.to(device=device, dtype=torch.int32).contiguous()


def check_kernel_tensors(checks, device) -> None:
    """The raw-pointer kernels' inputs: each (name, tensor, shape, dtype) must be a contiguous tensor
    of that shape and dtype on `device` (a CUDA device), 16-byte aligned (TMA); errors name it."""
    if device.type != "cuda":
        raise ValueError(f"the inputs must be CUDA tensors, got {device}")
    for name, t, shape, dt in checks:
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dt or t.device != device or not t.is_contiguous():
            got = None if t is None else f"{tuple(t.shape)} {t.dtype} on {t.device}"
            raise ValueError(f"{name} must be a contiguous {dt} tensor of shape {tuple(shape)} on {device}, got {got}")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned")
