"""flamia_cute as a Hugging Face transformers attention implementation, "flamia_fp8".

    import flamia_cute.hf
    flamia_cute.hf.register()  # AttentionInterface and AttentionMaskInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flamia_fp8")

Packed batches (`DataCollatorWithFlattening`, one row of documents) arrive as `cu_seq_lens_q/k` and
`max_length_q/k` (with `return_flash_attn_kwargs=True`, no host read per layer) or as `position_ids` that
restart at every document (read once per layer, as transformers' flash path does). A 2D padding mask is
unpadded into documents; otherwise the batch rows are the documents. Every call goes to
flamia_attn_varlen_func on the unchanged tensors (a transposed view of the model's (B, S, H, D) projections is
already THD memory), so its numerics are ours bit for bit: the kernels where they run, the emulator elsewhere,
and a GPU call the kernels cannot run warns once (interface.choose_backend). What flamia does not compute
(dropout, soft-capping, sliding windows, attention sinks, 4D masks, a value head dim other than the query's)
is an error naming the argument.
"""

from __future__ import annotations

import torch

from .interface import flamia_attn_varlen_func
from .recipes import DEFAULT_RECIPE, Recipe, resolve_recipe

ATTN_NAME = "flamia_fp8"
# keyword arguments that change the attention flamia computes: a value that is set is an error
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


def register(name: str = ATTN_NAME, recipe: str | Recipe = DEFAULT_RECIPE) -> str:
    """Register `name` with transformers' AttentionInterface (attention) and AttentionMaskInterface (masks: none,
    or the 2D padding mask, as for flash attention). Returns the name for attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(name, attention_function(recipe))
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


def attention_function(recipe: str | Recipe = DEFAULT_RECIPE):
    """The AttentionInterface function of `recipe`: fn(module, query, key, value, attention_mask, ...) with query
    (B, H, L, D), key and value (B, Hk, S, D); returns ((B, L, H, D) output, None)."""
    resolve_recipe(recipe)

    def flamia_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: float | None = None, is_causal: bool | None = None, **kwargs):
        return _forward(recipe, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)

    flamia_attention_forward.recipe = recipe
    return flamia_attention_forward


def _forward(recipe, module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    if dropout:
        raise ValueError(f"{ATTN_NAME}: dropout={dropout} is not supported (set the config's attention_dropout to 0)")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{ATTN_NAME}: {name} is not supported")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{ATTN_NAME}: output_attentions=True is not supported (attention weights are never formed)")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{ATTN_NAME}: attention_mask must be None or a 2D padding mask, got {attention_mask.dim()}D "
                         f"(register() installs the mask function that makes one)")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"{ATTN_NAME}: value head dim {value.shape[-1]} must equal the query's {query.shape[-1]}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    B, H, L, D = query.shape
    S = key.shape[2]
    dtype = query.dtype
    # fp32 activations (e.g. PEFT's fp32 norms): FP8 attention quantizes bf16 inputs
    qkv = [t.transpose(1, 2) if t.dtype != torch.float32 else t.transpose(1, 2).to(torch.bfloat16)
           for t in (query, key, value)]
    cu_q, cu_k, max_q, max_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), \
        kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if attention_mask is not None:
        out = _padded(recipe, qkv, attention_mask.bool(), scaling, causal)
    else:
        if cu_q is None and B == 1 and L > 1 and kwargs.get("position_ids") is not None:
            cu_q, max_q = _documents_from_positions(kwargs["position_ids"], L)
            cu_k, max_k = (cu_q, max_q) if S == L else (None, None)
        if cu_q is None or cu_k is None:
            cu_q, cu_k, max_q, max_k = _uniform(B, L, query.device), _uniform(B, S, query.device), L, S
        q, k, v = (t.reshape(-1, t.shape[2], D) for t in qkv)
        out = flamia_attn_varlen_func(q, k, v, _int32(cu_q), _int32(cu_k), int(max_q), int(max_k), scaling, causal,
                                      recipe=recipe).view(B, L, H, D)
    return out.to(dtype), None


def _int32(cu: torch.Tensor) -> torch.Tensor:
    return cu if cu.dtype == torch.int32 else cu.to(torch.int32)


def _uniform(batch: int, length: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


def _documents_from_positions(position_ids: torch.Tensor, length: int):
    """cu_seqlens and the longest document of one packed row whose positions restart at every document (a host
    read). Positions that never restart: one document."""
    pos = position_ids.reshape(-1)[-length:]
    starts = (pos == pos.min()).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_tensor([length])])
    return cu, int((cu[1:] - cu[:-1]).max())


def _padded(recipe, qkv, mask: torch.Tensor, scaling, causal: bool) -> torch.Tensor:
    """A (B, S) padding mask: each row's valid tokens are one document; queries are the mask's last L columns
    (causal aligned to the end, as decoding with a cache needs). Padded query rows get zeros."""
    q, k, v = qkv
    B, L, H, D = q.shape
    q_mask = mask[:, -L:]
    len_q, len_k = q_mask.sum(1, dtype=torch.int32), mask.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(len_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(len_k.cumsum(0, dtype=torch.int32), (1, 0))
    out_rows = flamia_attn_varlen_func(q[q_mask], k[mask], v[mask], cu_q, cu_k, int(len_q.max()), int(len_k.max()),
                                       scaling, causal, recipe=recipe)
    out = out_rows.new_zeros(B, L, H, D)
    out[q_mask] = out_rows
    return out
