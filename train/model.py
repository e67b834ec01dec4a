"""A small Llama-style decoder over packed documents (THD layout, cu_seqlens boundaries).

RMSNorm, rotary embeddings whose positions restart at 0 at every document start,
SwiGLU MLP, head dim 128, optional GQA. Attention is pluggable (AttentionSpec):
flamia_attn_varlen_func with a recipe, FA4 bf16 (GPU control), or plain per-document
SDPA (CPU reference). With flamia the rotary embedding runs inside its quantization
(rotary=): the same fp32 rotation of the bf16 Q and K (on the CPU the fp32 model casts them first), no
separate pass over Q and K.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.recipes import resolve_recipe
from flamia_cute.rotary import Rotary

ATTENTION_KINDS = ("flamia", "fa4", "sdpa")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    head_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")


def preset(name: str, vocab_size: int) -> ModelConfig:
    """llama_125m: GPT-2-small-sized trunk (the byte vocabulary adds almost nothing); tiny: for CPU tests."""
    if name == "llama_125m":
        # SwiGLU hidden 3072 (4x, not Llama's 8/3x) keeps the count near 113M without a big vocabulary.
        return ModelConfig(vocab_size, d_model=768, n_layers=12, n_heads=6, n_kv_heads=6, ffn_hidden=3072)
    if name == "tiny":
        return ModelConfig(vocab_size, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=512)
    raise ValueError(f"preset must be 'llama_125m' or 'tiny', got {name!r}")


@dataclass(frozen=True)
class AttentionSpec:
    kind: str = "flamia"  # one of ATTENTION_KINDS
    recipe: str = "fp8_tokenblock_dsbf16"  # flamia only ("none" for the others)
    backend: str = "auto"  # flamia only: auto | emulate | cute

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind must be one of {ATTENTION_KINDS}, got {self.kind!r}")
        if self.kind == "flamia":
            resolve_recipe(self.recipe)  # fail before training, with the list of named recipes

    def check_device(self, device: torch.device) -> None:
        if self.kind == "fa4":
            if device.type != "cuda":
                raise RuntimeError("attention 'fa4' (flash_attn.cute) runs on the GPU only; use 'sdpa' on the CPU")
            _fa4_varlen_func()  # raises with an install hint when flash-attn-4 is missing


@lru_cache(maxsize=1)
def _fa4_varlen_func():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        raise RuntimeError(f"attention 'fa4' needs the flash-attn-4 package (flash_attn.cute): {e}") from e
    return flash_attn_varlen_func


def positions_in_documents(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Position of every token inside its own document (0 at each document start); no host sync."""
    idx = torch.arange(total_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens, idx, right=True) - 1  # right=True skips empty documents
    return (idx - cu_seqlens[doc]).long()


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention (Llama); computed in fp32, returned in x's dtype. x: (T, heads, head_dim)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class AttentionTimer:
    """Attention time per step, forward and backward: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start, end):
        self.spans.append((start, end))

    def pop_ms(self) -> float:
        """Sum of the recorded spans; call after the step has synchronized."""
        if self.cuda:
            total = sum(s.elapsed_time(e) for s, e in self.spans)
        else:
            total = 1000.0 * sum(e - s for s, e in self.spans)
        self.spans = []
        return total


class _BackwardStart(torch.autograd.Function):
    """Identity on attention's output; its backward runs just before attention's backward."""

    @staticmethod
    def forward(ctx, timer, pending, out):
        ctx.timer, ctx.pending = timer, pending
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.pending.append(ctx.timer.mark())
        return None, None, grad


class _BackwardEnd(torch.autograd.Function):
    """Identity on attention's inputs; its backward runs once attention's backward produced dq, dk, dv."""

    @staticmethod
    def forward(ctx, timer, pending, q, k, v):
        ctx.timer, ctx.pending = timer, pending
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        if ctx.pending:
            ctx.timer.add(ctx.pending.pop(), ctx.timer.mark())
        return None, None, dq, dk, dv


def sdpa_varlen(q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention one document at a time with torch SDPA: no attention across documents by construction."""
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        qd = q[start:end].transpose(0, 1)
        kd = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)  # q head h reads kv head h // group
        vd = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


@dataclass
class RopeTables:
    """A batch's rotary tables: per token (cos, sin (T, D/2): the unfused rotation) and per position
    (Rotary, (max_seqlen, D/2): flamia's fused one); rows of equal position hold the same values."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    by_position: Rotary | None


def attention_varlen(q, k, v, cu_seqlens, max_seqlen: int, spec: AttentionSpec, timer: AttentionTimer | None = None,
                     rotary: Rotary | None = None):
    """Causal attention over packed documents. q: (T, H, D); k, v: (T, Hkv, D). Returns (T, H, D) in q's dtype.
    rotary (flamia only): RoPE of q and k inside the attention's quantization."""
    timing_backward = timer is not None and torch.is_grad_enabled()
    if timing_backward:
        pending = []
        q, k, v = _BackwardEnd.apply(timer, pending, q, k, v)
    start = timer.mark() if timer is not None else None
    if spec.kind == "flamia":
        bf = torch.bfloat16  # the FP8 recipes take bf16 inputs; on the CPU the model runs in fp32
        out = flamia_attn_varlen_func(
            q.to(bf), k.to(bf), v.to(bf), cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
            causal=True, recipe=spec.recipe, backend=spec.backend, rotary=rotary,
        ).to(q.dtype)
    elif rotary is not None:
        raise ValueError(f"attention_varlen: rotary= is flamia's fused RoPE; attention {spec.kind!r} takes rotated q, k")
    elif spec.kind == "fa4":
        res = _fa4_varlen_func()(
            q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, causal=True,
        )
        out = res[0] if isinstance(res, tuple) else res  # some FA4 versions return (out, lse)
    else:
        out = sdpa_varlen(q, k, v, cu_seqlens)
    if timer is not None:
        timer.add(start, timer.mark())
    if timing_backward:
        out = _BackwardStart.apply(timer, pending, out)
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.d_model, bias=False)

    def forward(self, x, rope: RopeTables, cu_seqlens, max_seqlen, timer):
        t, hd = x.shape[0], self.cfg.head_dim
        q = self.wq(x).view(t, self.cfg.n_heads, hd)
        k = self.wk(x).view(t, self.cfg.n_kv_heads, hd)
        v = self.wv(x).view(t, self.cfg.n_kv_heads, hd)
        if self.spec.kind == "flamia":  # rotated inside the attention's quantization
            out = attention_varlen(q, k, v, cu_seqlens, max_seqlen, self.spec, timer, rotary=rope.by_position)
        else:
            q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
            out = attention_varlen(q, k, v, cu_seqlens, max_seqlen, self.spec, timer)
        return self.wo(out.reshape(t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w_down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, spec)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, rope, cu_seqlens, max_seqlen, timer):
        x = x + self.attn(self.attn_norm(x), rope, cu_seqlens, max_seqlen, timer)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: AttentionSpec = AttentionSpec()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, spec) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.set_attention(spec)
        self.reset_parameters()

    def set_attention(self, spec: AttentionSpec) -> None:
        """Swap the attention implementation (same weights), e.g. to evaluate a model under another recipe."""
        self.spec = spec
        for block in self.blocks:
            block.attn.spec = spec

    def reset_parameters(self):
        # GPT-2 style: N(0, 0.02), residual output projections scaled down by depth.
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = resid_std if name.endswith(("wo.weight", "w_down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens, cu_seqlens, max_seqlen: int, timer: AttentionTimer | None = None):
        """tokens: (T,) int64 packed documents; returns logits (T, vocab)."""
        x = self.embed(tokens)
        rope = self.rope_tables(cu_seqlens, tokens.shape[0], max_seqlen, x.device)
        for block in self.blocks:
            x = block(x, rope, cu_seqlens, max_seqlen, timer)
        return self.lm_head(self.final_norm(x))

    def rope_tables(self, cu_seqlens, total: int, max_seqlen: int, device) -> RopeTables:
        """The batch's rotary tables: by position for flamia's fused RoPE (rotary_tables of positions
        0 .. max_seqlen - 1, the same fp32 values as the per-token ones), per token for the others."""
        if self.spec.kind == "flamia":
            cos, sin = rotary_tables(torch.arange(max(int(max_seqlen), 1), device=device), self.cfg.head_dim,
                                     self.cfg.rope_theta)
            return RopeTables(None, None, Rotary(cos, sin))
        positions = positions_in_documents(cu_seqlens, total)
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return RopeTables(cos, sin, None)
