"""The integration paths on an sm_90 GPU with the kernels: varlen_attn and SDPA through FLAMIA_FP8, the Hugging Face
function, context parallelism at world size 1, train --fsdp --compile at world size 1. Each against a direct
flamia_attn_varlen_func call on the same inputs, bit for bit (the deterministic backward: dQ's adds in order)."""

import inspect
import os
import socket
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from flamia_cute import flamia_attn_varlen_func
from flamia_cute.testing import cu_seqlens_from_lengths

pytestmark = pytest.mark.gpu


def FLASH():
    """SDPA's flash backend, the path FLAMIA_FP8 serves."""
    return torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION)


DEV = "cuda"


@pytest.fixture
def deterministic(monkeypatch):
    monkeypatch.setenv("FLAMIA_CUTE_DETERMINISTIC", "1")


@pytest.fixture
def active(monkeypatch):
    import flamia_cute.torch_backend as tb

    monkeypatch.setattr(tb, "_WARNED", set())
    tb.activate()
    yield tb
    torch.nn.attention.restore_flash_attention_impl()


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.bfloat16)


def _direct(q, k, v, cu, max_len, do):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flamia_attn_varlen_func(*leaves, cu, cu, max_len, max_len, return_lse=True)
    return (out, lse, *torch.autograd.grad(out, leaves, do))


def _no_fallback():
    return warnings.catch_warnings(record=True)


def test_varlen_attn_runs_the_kernels_bit_for_bit(active, deterministic):
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    lengths = [3000, 517, 1, 4000, 130]
    cu, T = cu_seqlens_from_lengths(lengths, DEV), sum(lengths)
    q, k, v, do = (_rand(T, 8, 128, seed=s) for s in (1, 2, 3, 4))
    params = inspect.signature(varlen_attn).parameters
    causal_kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with _no_fallback() as w:
        warnings.simplefilter("always")
        out, lse = varlen_attn(*leaves, cu, cu, 4000, 4000, return_aux=AuxRequest(lse=True), **causal_kw)
        grads = torch.autograd.grad(out, leaves, do)
    assert not [m for m in w if "FLAMIA_FP8" in str(m.message) or "emulator" in str(m.message)]
    for a, b in zip((out, lse, *grads), _direct(q, k, v, cu, 4000, do), strict=True):
        assert torch.equal(a, b)


def test_sdpa_runs_the_kernels_bit_for_bit_causal_and_not(active, deterministic):
    B, H, L, D = 2, 8, 2048, 128
    q, k, v, do = (_rand(B, H, L, D, seed=s) for s in (5, 6, 7, 8))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with FLASH():  # torch picks cuDNN's attention over the flash path on an H200 unless told
        out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    grads = torch.autograd.grad(out, leaves, do)

    def thd(t):
        return t.transpose(1, 2).reshape(B * L, H, D)

    cu = cu_seqlens_from_lengths([L] * B, DEV)
    for a, b in zip((out, *grads), [r for i, r in enumerate(_direct(*map(thd, (q, k, v)), cu, L, thd(do))) if i != 1],
                    strict=True):
        assert torch.equal(thd(a), b)
    with warnings.catch_warnings(record=True) as w:  # non-causal: the kernels' non-causal builds
        warnings.simplefilter("always")
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with FLASH():
            out = F.scaled_dot_product_attention(*leaves, is_causal=False)
        grads = torch.autograd.grad(out, leaves, do)
    assert not [m for m in w if "FLAMIA_FP8" in str(m.message) or "emulator" in str(m.message)]
    direct = [t.detach().clone().requires_grad_() for t in map(thd, (q, k, v))]
    o = flamia_attn_varlen_func(*direct, cu, cu, L, L, causal=False)
    for a, b in zip((out, *grads), (o, *torch.autograd.grad(o, direct, thd(do))), strict=True):
        assert torch.equal(thd(a), b)


def test_hf_llama_runs_the_kernels_and_matches_sdpa(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import flamia_cute.hf as fhf
    import flamia_cute.interface as iface

    monkeypatch.setattr(iface, "_WARNED", set())  # a fallback warned earlier in the session would not warn again

    fhf.register()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(9)
    feats = [{"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in (1500, 37, 900, 600)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
    batch = {k: v.to(DEV) if hasattr(v, "to") else v for k, v in batch.items()} | {"use_cache": False}
    losses = {}
    for attn in (fhf.ATTN_NAME, "sdpa"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16)
        model.set_attn_implementation(attn)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = model(**batch)
            out.loss.backward()
        assert not [m for m in w if "emulator" in str(m.message)] and not iface._WARNED
        losses[attn] = out.loss.item()
    assert abs(losses[fhf.ATTN_NAME] - losses["sdpa"]) <= 1e-2 * losses["sdpa"], losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_context_parallel_world_size_1_is_the_direct_call(deterministic):
    import torch.distributed as dist

    from flamia_cute.distributed import context_parallel_attn, shard_packed_batch

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        lengths = [3000, 517, 1, 4000, 130]
        cu, T = cu_seqlens_from_lengths(lengths, DEV), sum(lengths)
        q, k, v, do = (_rand(T, 8, 128, seed=s) for s in (10, 11, 12, 13))
        shard = shard_packed_batch(cu, 1, 0)
        leaves = [shard.take(t).detach().requires_grad_() for t in (q, k, v)]
        out, lse = context_parallel_attn(*leaves, shard, return_lse=True)
        grads = torch.autograd.grad(out, leaves, shard.take(do))
        for a, b in zip((out, lse, *grads), _direct(q, k, v, cu, 4000, do), strict=True):
            assert torch.equal(a, b)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu_full  # compiles the tiny model with inductor: ~1-2 min
def test_train_fsdp_compile_world_size_1(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from train import run

    for k, val in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                       LOCAL_RANK="0").items():
        monkeypatch.setenv(k, val)
    summary = run.main(["--preset", "tiny", "--steps", "4", "--tokens-per-step", "16384", "--eval-every", "0",
                        "--eval-batches", "1", "--leak-samples", "0", "--fsdp", "--compile", "--out", str(tmp_path)])
    assert summary["fsdp"] and summary["compile"] and summary["diverged_at"] is None
