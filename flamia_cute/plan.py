"""One dispatch path: a named recipe and a call's shapes give one frozen Plan, built once per call signature.

Every route to the sm_90a kernels (the eager autograd function, the torch.library ops that
torch.compile traces, the no-grad forward, the tuner) runs a call from its Plan: how K and V are
scaled, the forward's config, the Q/K/V quantization launch (whose layouts are what the call saves
for its backward) and the backward's config, or None where the recipe's backward is the emulator's.
Configs come tuned for the call's workload class (tuned.py) and are memoized with the tuned records.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from .recipes import NAMED_RECIPES, Recipe

# The named recipes whose forward the sm_90a kernels run, and how those kernels take K and V:
# "tokenblock" (128-token document-local blocks plus per-token copies on the diagonal tile),
# "token" (per token), "tensor" (one scale per tensor, quantized by torch into the per-token layouts:
# the leaky control, run on the kernels so that the kernel path's leakage tests have a control).
KERNEL_SCALINGS = {"fp8_tokenblock_dsbf16": "tokenblock", "fp8_tokenblock": "tokenblock", "fp8_token": "token",
                   "fp8_tensor_current": "tensor", "fp8_tokenblock_hadamard": "tokenblock"}
KERNEL_HEAD_DIMS = (64, 128)


def kernel_scaling(recipe: Recipe) -> str | None:
    """How the kernels scale K and V for `recipe`, or None where no kernel runs its forward (other
    recipes, and recipes that only share a name with a named one)."""
    scaling = KERNEL_SCALINGS.get(recipe.name)
    return scaling if scaling is not None and NAMED_RECIPES[recipe.name] == recipe else None


def has_backward_kernel(recipe: Recipe) -> bool:
    """The sm_90a backward kernel implements dS in bf16 with dV's fold per document; the e4m3-dS
    recipes run the emulator's backward from the forward's saved operands (the same quantized
    values, so forward and backward stay consistent)."""
    return recipe.ds_cast == "bf16" and recipe.dv_fold == "document"


def _why_not_call(arch: str, kernels, has_kernel: bool, head_dims, recipe: Recipe, causal: bool, q, k, cu_q, cu_k,
                  any_keys: bool = False):
    """The reasons both architectures' kernels share: recipe, causal, self-attention, head dim. The emulator runs
    every call. any_keys: the kernels also run non-causal attention and queries that are a sub-range of their
    document's keys (cross-length, causal aligned to the end of each query range; docs/integration.md), else
    those are the emulator's."""
    if not has_kernel:
        return f"recipe {recipe.name!r} has no {arch} kernel (kernels: {kernels})"
    if not causal and not any_keys:
        return f"causal=False has no {arch} kernel"
    if not any_keys and (q.shape[0] != k.shape[0] or not same_documents(cu_q, cu_k)):
        return (f"queries that are a sub-range of their document's keys (cu_seqlens_q != cu_seqlens_k) have no "
                f"{arch} kernel: the {arch} kernels are self-attention only")
    if q.shape[-1] not in head_dims:
        return f"head_dim {q.shape[-1]} has no {arch} kernel ({', '.join(map(str, head_dims))})"
    return None


def same_documents(cu_q: torch.Tensor, cu_k: torch.Tensor) -> bool:
    """cu_seqlens_q == cu_seqlens_k. Integrations pass two tensors with equal values to every layer (Hugging Face's
    collator makes cu_seq_lens_q and cu_seq_lens_k separately): the answer is kept on cu_q's object, for this cu_k
    object at these versions, so that a GPU pair is read once per batch instead of once per layer."""
    if cu_q is cu_k:
        return True
    if cu_q.shape != cu_k.shape:
        return False
    from .validation import has_no_values

    if has_no_values(cu_q) or has_no_values(cu_k):
        return False  # values unknown (FakeTensorMode outside torch.compile): the separate-keys plan serves both
    if torch.compiler.is_compiling() or not hasattr(cu_q, "__dict__"):
        return torch.equal(cu_q, cu_k)
    versions = (cu_q._version, cu_k._version)
    memo = cu_q.__dict__.get("_flamia_same_documents")
    if memo is not None and memo[0]() is cu_k and memo[1] == versions:
        return memo[2]
    same = torch.equal(cu_q, cu_k)
    cu_q.__dict__["_flamia_same_documents"] = (weakref.ref(cu_k), versions, same)
    return same


def why_not_rotary(rotary) -> str | None:
    """Why the sm_90a kernels cannot apply this RoPE (rotary.Rotary; None: they can): a lane pairs whole
    16-channel slices (half-split: rotary_dim a multiple of 32; interleaved: of 16)."""
    if rotary is None:
        return None
    align = 16 if rotary.interleaved else 32
    if rotary.rotary_dim % align:
        return (f"rotary_dim {rotary.rotary_dim} has no sm_90a kernel ({'interleaved' if rotary.interleaved else 'half-split'} "
                f"RoPE: a multiple of {align})")
    return None


def why_not_rotations(recipe: Recipe, rotary, separate: bool) -> str | None:
    """Why the sm_90a kernels cannot rotate this call's Q and K (None: they can): the rotations (RoPE, a
    Hadamard recipe's transform) and their inverses in the backward (the dK epilogue at self-attention
    positions, the dQ conversion over cu_seqlens_q) are for causal self-attention builds only."""
    if not separate or (rotary is None and not recipe.hadamard):
        return None
    what = "RoPE" if rotary is not None else f"recipe {recipe.name!r} (a Hadamard transform)"
    return (f"{what} with cross-length or non-causal attention has no sm_90a kernel (the kernels' rotations are "
            "for causal self-attention: cu_seqlens_q == cu_seqlens_k)")


def why_not_kernels(recipe: Recipe, causal: bool, q, k, cu_q, cu_k, rotary=None) -> str | None:
    """Why the sm_90a kernels cannot run this call (None: they can). They run causal self-attention, cross-length
    causal and non-causal attention (separate_keys: the kernels' cross-length and non-causal builds); RoPE and
    the Hadamard recipes with causal self-attention only (why_not_rotations)."""
    why = _why_not_call("sm_90a", sorted(KERNEL_SCALINGS), kernel_scaling(recipe) is not None, KERNEL_HEAD_DIMS,
                        recipe, causal, q, k, cu_q, cu_k, any_keys=True)
    if why is None:
        why = why_not_rotary(rotary)
    if why is None:
        why = why_not_rotations(recipe, rotary, separate_keys(causal, q.shape[0], k.shape[0], cu_q, cu_k))
    return why


def separate_keys(causal: bool, q_tokens: int, k_tokens: int, cu_q, cu_k) -> bool:
    """Whether a kernel call takes its own key documents (the builds with cross_length or causal=False) instead
    of running causal self-attention: non-causal, or other key documents (same_documents, which the dispatch
    has already asked for these tensors: its memo answers)."""
    return not causal or q_tokens != k_tokens or not same_documents(cu_q, cu_k)


# The named recipes whose forward the sm_100a kernels run (never yet on hardware; opt-in only, see
# interface.SM100_ENV), and the head dims they compile for: one 512-byte scale chunk per 128 x 128 tile.
SM100_RECIPES = ("mxfp8",)
SM100_HEAD_DIMS = (128,)


def why_not_sm100(recipe: Recipe, causal: bool, q, k, cu_q, cu_k, rotary=None) -> str | None:
    """Why the sm_100a MXFP8 forward cannot run this call (None: it can)."""
    has = recipe.name in SM100_RECIPES and NAMED_RECIPES[recipe.name] == recipe
    why = _why_not_call("sm_100a", list(SM100_RECIPES), has, SM100_HEAD_DIMS, recipe, causal, q, k, cu_q, cu_k)
    if why is not None:
        return why
    if rotary is not None:
        return "rotary has no sm_100a kernel"
    if q.dtype != torch.bfloat16:
        return f"the sm_100a kernels take bfloat16 inputs, got {q.dtype}"
    return None


def deterministic_backward() -> bool:
    """Bit-reproducible dQ: torch.use_deterministic_algorithms(True), or FLAMIA_CUTE_DETERMINISTIC=1."""
    flag = os.environ.get("FLAMIA_CUTE_DETERMINISTIC", "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"FLAMIA_CUTE_DETERMINISTIC must be 0 or 1, got {flag!r}")
    return flag == "1" or torch.are_deterministic_algorithms_enabled()


@dataclass(frozen=True)
class Plan:
    """What the kernels run for one call signature."""

    recipe: str
    scaling: str  # KERNEL_SCALINGS' values
    fwd: object  # sm90.attention_fwd.FwdConfig
    qkv: object  # sm90.quantize.MultiQuantizeConfig: the layouts the forward and either backward read
    bwd: object | None  # sm90.attention_bwd.BwdDsBf16Config; None: the emulator's backward
    # sm90.rotate.GradRotateConfig: the dQ conversion with the inverse rotations of Q (RoPE, the
    # recipe's Hadamard transform); None: a plain cast (no rotations, or the emulator's backward)
    dq_convert: object | None = None

    @property
    def block(self) -> int:
        """K/V token-block size of the quantized layouts."""
        return 128 if self.scaling == "tokenblock" else 1

    @property
    def separate_keys(self) -> bool:
        """The call's K and V have their own documents (cu_seqlens_k): quantized over them, the forward's
        cross-length or non-causal build."""
        return self.fwd.separate_keys


def make_plan(recipe: str, head_dim: int, heads_q: int, heads_kv: int, max_seqlen: int, total_tokens: int,
              num_docs: int, causal: bool = True, separate: bool = False,
              rotary: tuple[str, int] | None = None, deterministic: bool = False) -> Plan:
    """The Plan of a call (recipe: a name in KERNEL_SCALINGS; rotary: custom_ops.rotary_key, the RoPE mode
    and width, or None), memoized per signature while the tuned records stay loaded (tuned.derived_memo):
    building and tuning configs costs host time that every layer of every step would pay again.
    separate (separate_keys): K and V have their own documents, as cross-length causal (causal) or
    non-causal attention; max_seqlen and total_tokens are the queries'. Rotations (rotary, a Hadamard
    recipe) are for causal self-attention only (why_not_kernels). deterministic: the call asks for the
    bit-reproducible backward (so does deterministic_backward(), whatever the call says)."""
    from .tuned import derived_memo

    deterministic = deterministic_backward() or bool(deterministic)  # the switch checked whatever the call says
    key = ("plan", recipe, head_dim, heads_q, heads_kv, int(max_seqlen), total_tokens, num_docs, rotary,
           deterministic, os.environ.get("FLAMIA_CUTE_NO_TUNING"), causal, separate or not causal)
    memo = derived_memo()
    plan = memo.get(key)
    if plan is None:
        plan = memo[key] = _build_plan(recipe, head_dim, heads_q, heads_kv, int(max_seqlen), total_tokens, num_docs,
                                       causal, separate or not causal, rotary, deterministic)
    return plan


def qkv_launch(head_dim: int, heads_q: int, heads_kv: int, block: int, max_seqlen: int, total_tokens: int,
               num_docs: int, tuned: bool = True):
    """A call's Q/K/V launch (block: K/V tokens per scale, 1 or 128), tuned for its workload class, reduced
    to the forward's layouts: all that either backward reads (the kernel takes Q's bf16 copy, converts K
    and transposes V in shared memory; the emulator dequantizes V from its transposed copy)."""
    from .sm90.quantize import forward_only, qkv_config
    from .tuned import tuned_quantize_config

    qkv = qkv_config(head_dim, heads_q, heads_kv, block)
    if tuned:
        qkv = tuned_quantize_config(qkv, max_seqlen, total_tokens, num_docs)
    return forward_only(qkv)


def _build_plan(recipe, head_dim, heads_q, heads_kv, max_seqlen, total_tokens, num_docs, causal=True,
                separate=False, rotary=None, deterministic=False) -> Plan:
    from dataclasses import replace

    from .rotary import hadamard_shift
    from .schedules.varlen_tiles import short_pairs_worth
    from .sm90.attention_bwd import BwdDsBf16Config, auto_head_window, short_pairs_supported
    from .sm90.attention_fwd import FwdConfig, short_pairs_default
    from .sm90.quantize import with_rotations
    from .sm90.rotate import GradRotateConfig
    from .tuned import tuned_bwd_dsbf16_config, tuned_fwd_config

    scaling = KERNEL_SCALINGS[recipe]
    hadamard = NAMED_RECIPES[recipe].hadamard
    why = why_not_rotations(NAMED_RECIPES[recipe], rotary, separate)
    if why is not None:  # the dispatch asked why_not_kernels first
        raise ValueError(why)
    rot_mode, rot_dim = rotary if rotary is not None else ("none", 0)
    rotations = dict(rotary=rot_mode, rotary_dim=rot_dim)
    block_copy = scaling == "tokenblock"
    group = heads_q // heads_kv
    fwd = tuned_fwd_config(FwdConfig(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=block_copy,
                                     short_pairs=short_pairs_default(total_tokens, num_docs)),
                           max_seqlen, total_tokens, num_docs)
    if separate:  # self-attention's tuned schedule, without short pairs (self-attention documents only)
        fwd = replace(fwd, short_pairs=False, causal=causal, cross_length=causal)
    # the control is quantized by torch: no launch to tune
    qkv = qkv_launch(head_dim, heads_q, heads_kv, 128 if block_copy else 1, max_seqlen, total_tokens, num_docs,
                     tuned=scaling != "tensor")
    if rotary is not None or hadamard:
        qkv = with_rotations(qkv, rot_mode, rot_dim, hadamard)
    bwd = None
    dq_convert = None
    if has_backward_kernel(NAMED_RECIPES[recipe]):
        # the dK epilogue applies K's inverse rotations; the dQ conversion Q's
        k_rot = dict(rotations, hadamard=hadamard_shift(head_dim, "k") if hadamard else 0)
        if deterministic:  # dQ in key-block turns, untuned
            bwd = BwdDsBf16Config(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=block_copy,
                                  deterministic=True, **k_rot)
        else:
            bwd = BwdDsBf16Config(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=block_copy,
                                  head_window=auto_head_window(heads_kv, max_seqlen), **k_rot)
            if short_pairs_worth(total_tokens, num_docs) and short_pairs_supported(bwd):
                bwd = replace(bwd, short_pairs=True)
            bwd = tuned_bwd_dsbf16_config(bwd, max_seqlen, total_tokens, num_docs)
        if separate:  # self-attention's schedule, without short pairs
            bwd = replace(bwd, short_pairs=False, causal=causal, cross_length=causal)
        if rotary is not None or hadamard:
            dq_convert = GradRotateConfig(head_dim, hadamard=hadamard_shift(head_dim, "q") if hadamard else 0,
                                          **rotations)
    return Plan(recipe, scaling, fwd, qkv, bwd, dq_convert)
