"""flamia_cute as a Hugging Face transformers attention implementation, "flamia_fp8".

    import flamia_cute.hf
    flamia_cute.hf.register()  # AttentionInterface and AttentionMaskInterface
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flamia_fp8")

Packed batches (`DataCollatorWithFlattening`) arrive as `cu_seq_lens_q/k` and `max_length_q/k` (with
`return_flash_attn_kwargs=True`, no host read per layer) or as `position_ids` that restart at every document
(read once per layer): a document starts at every row's first token and wherever a position is not its
predecessor's plus one, in any number of rows (as sdpa's packed-sequence mask reads them). A 2D padding mask
is unpadded into documents (keys past the mask's length, a static cache's empty slots, are dropped);
otherwise, and with a cache, the batch rows are the documents. Every call goes to
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
        pos = kwargs.get("position_ids")
        if cu_q is None and pos is not None:
            if S > L:  # a cache: a static one has slots past the last position (a host read)
                S = min(S, int(pos.max()) + 1)
                qkv[1], qkv[2] = qkv[1][:, :S], qkv[2][:, :S]
            if L > 1 and S == L:
                cu_q, max_q = _documents_from_positions(pos, B, L)
                cu_k, max_k = cu_q, max_q
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


def _documents_from_positions(position_ids: torch.Tensor, batch: int, length: int):
    """cu_seqlens over the batch's B * L tokens and the longest document (a host read): a document starts at
    each row's first token and wherever a position is not the previous one plus one. Positions that never
    restart: one document per row."""
    pos = position_ids.reshape(-1, position_ids.shape[-1])[:, -length:].expand(batch, length)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    starts = start.reshape(-1).nonzero().flatten().to(torch.int32)
    cu = torch.cat([starts, starts.new_tensor([batch * length])])
    return cu, int((cu[1:] - cu[:-1]).max())


def _padded(recipe, qkv, mask: torch.Tensor, scaling, causal: bool) -> torch.Tensor:
    """A (B, S) padding mask: each row's valid tokens are one document; queries are the mask's last L columns
    (causal aligned to the end, as decoding with a cache needs). Padded query rows get zeros."""
    q, k, v = qkv
    B, L, H, D = q.shape
    # a static cache's keys have slots past the tokens seen so far, which the mask does not cover
    k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    q_mask = mask[:, -L:]
    len_q, len_k = q_mask.sum(1, dtype=torch.int32), mask.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(len_q.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(len_k.cumsum(0, dtype=torch.int32), (1, 0))
    out_rows = flamia_attn_varlen_func(q[q_mask], k[mask], v[mask], cu_q, cu_k, int(len_q.max()), int(len_k.max()),
                                       scaling, causal, recipe=recipe)
    out = out_rows.new_zeros(B, L, H, D)
    out[q_mask] = out_rows
    return out
