"""The cuDNN FP8 baseline (flamia_cute/baselines/cudnn_fp8.py) and the direct call it is checked against
(perf/cudnn_direct.py) on the CPU, against a stand-in for cudnn-frontend that checks what a real graph
checks on the host: every graph tensor bound in each variant pack and nothing else, outputs declared,
the amax outputs a cuDNN may insist on. The GPU timing is perf/cudnn_direct.py's."""

from __future__ import annotations

import pathlib
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from flamia_cute.baselines import cudnn_fp8

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "perf"))

import cudnn_direct  # noqa: E402


class _T:
    def __init__(self, g, uid=None, name=None, dim=None, virtual=False):
        self.g, self.uid, self.name, self.dim, self.virtual, self.output = g, uid, name, dim, virtual, False

    def set_output(self, v):
        self.output = v
        return self

    def set_uid(self, u):
        self.uid = u
        return self

    def set_dim(self, d):
        self.dim = tuple(d)
        return self

    def set_stride(self, _s):
        return self

    def set_data_type(self, _t):
        return self


class _Graph:
    def __init__(self, fake):
        self.fake, self.tensors, self.amax, self.results, self.executed = fake, [], [], [], []

    def tensor(self, name=None, uid=None, dim=None, stride=None, data_type=None):
        t = _T(self, uid, name, tuple(dim))
        self.tensors.append(t)
        return t

    def _virtual(self, n):
        out = [_T(self, virtual=True) for _ in range(n)]
        self.results += out
        return out

    def sdpa_fp8(self, q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, generate_stats,
                 attn_scale, use_causal_mask):
        assert generate_stats and use_causal_mask and attn_scale > 0
        o, stats, amax_s, amax_o = self._virtual(4)
        self.amax = [amax_s, amax_o][2 - self.fake.require_amax:] if self.fake.require_amax else []
        return o, stats, amax_s, amax_o

    def sdpa_fp8_backward(self, **kw):
        names = {"q", "k", "v", "o", "dO", "stats", "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO",
                 "descale_s", "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP", "attn_scale",
                 "use_causal_mask"}
        assert set(kw) == names, set(kw) ^ names
        out = self._virtual(7)
        self.amax = out[3:] if self.fake.require_amax else []
        return out

    def validate(self):
        for t in self.amax:
            if not t.output:
                raise RuntimeError("amax output not declared")
        data = self.results[:3] if len(self.results) == 7 else self.results[:2]
        assert all(t.output and t.dim for t in data), "an output without dims"

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        assert modes

    def check_support(self):
        pass

    def build_plans(self, policy=None):
        pass

    def get_workspace_size(self):
        return 64

    def get_execution_plan_count(self):
        return 2

    def get_workspace_size_plan_at_index(self, i):
        return 128 * (i + 1)

    def bound(self):
        return [t for t in self.tensors if not t.virtual] + [t for t in self.results if t.output]

    def _check(self, pack, ws):
        by_uid = {t.uid: t for t in self.bound()}
        keys = [by_uid[k] if isinstance(k, int) else k for k in pack]
        assert len(set(map(id, keys))) == len(keys) == len(self.bound()), "variant pack != the graph's tensors"
        assert {id(k) for k in keys} == {id(t) for t in self.bound()}
        for t, x in zip(keys, pack.values(), strict=True):
            assert isinstance(x, torch.Tensor)
            if t.dim and len(t.dim) == 4 and t.dim[3] > 1:  # BSHD data: (b, h, s, d) dims, (b, s, h, d) tensor
                b, h, s, d = t.dim
                assert tuple(x.shape) == (b, s, h, d), (t.name, t.uid, x.shape)
        assert ws.numel() >= 128 * 2

    def execute(self, pack, ws, handle=None):
        self._check(pack, ws)
        self.executed.append(None)

    def execute_plan_at_index(self, pack, ws, index, handle=None):
        self._check(pack, ws)
        self.executed.append(index)


def _fake_cudnn(require_amax: int) -> types.ModuleType:
    m = types.ModuleType("cudnn")
    m.require_amax = require_amax
    m.data_type = SimpleNamespace(FP8_E4M3="f8", FLOAT="f32")
    m.heur_mode = SimpleNamespace(A="A", FALLBACK="F")
    m.build_plan_policy = SimpleNamespace(ALL="ALL")
    m.pygraph = lambda **kw: _Graph(m)
    m.create_handle = lambda: "handle"
    m.set_stream = lambda handle, stream: None
    m.backend_version = lambda: 91900
    return m


@pytest.fixture
def eager_passes(monkeypatch):
    monkeypatch.setitem(cudnn_fp8.FUSION, "mode", "eager")  # no torch.compile on the CPU here
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=0))


def _inputs(b=2, s=64, hq=4, hkv=2, d=32):
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(b, s, h, d, generator=g).bfloat16()
    return mk(hq), mk(hkv), mk(hkv), mk(hq)


@pytest.mark.parametrize("require_amax", [0, 1, 2])
def test_wrapper_binds_every_graph_tensor_and_the_fewest_amax_outputs(monkeypatch, eager_passes, require_amax):
    monkeypatch.setitem(sys.modules, "cudnn", _fake_cudnn(require_amax))
    att = cudnn_fp8.CudnnFp8Attention(2, 4, 2, 64, 32, 0.125, autotune=False, device="cpu")
    # as few amax outputs as this cuDNN accepts: none, O's, both
    assert att.fwd_amax == ((), ("amax_o",), ("amax_s", "amax_o"))[require_amax]
    assert att.bwd_amax == (() if not require_amax else ("amax_dq", "amax_dk", "amax_dv", "amax_dp"))
    q, k, v, do = _inputs()
    out, saved = att.forward_bf16(q, k, v)
    dq, dk, dv = att.backward(do, *saved)
    assert att.fwd.executed == [None] and att.bwd.executed == [None]
    assert out.dtype == dq.dtype == torch.bfloat16 and dk.shape == k.shape and out.shape == q.shape
    # the quantization: power-of-two scales, V's for O; exact up to e4m3's rounding
    o8, desc, stats, (q8, k8, v8, dq_, dk_, dv_) = saved
    assert torch.equal(desc, dv_) and float(torch.log2(dv_)) == int(torch.log2(dv_))
    err = ((q8.float() * dq_ - q.float()).norm() / q.float().norm()).item()
    assert 0 < err < 0.05
    assert float(q8.float().abs().max()) <= 448 and float(q8.float().abs().max()) > 224


def test_wrapper_autotune_keeps_the_fastest_plan(monkeypatch, eager_passes):
    fake = _fake_cudnn(0)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    att = cudnn_fp8.CudnnFp8Attention(2, 4, 2, 64, 32, 0.125, autotune=False, device="cpu")
    assert att.ws.numel() == 256  # the largest plan's workspace
    times = {0: 3.0, 1: 1.0}

    class _Ev:
        def __init__(self, **kw):
            self.t = 0.0

        def record(self):
            self.t = times[att.fwd.executed[-1]] * len(att.fwd.executed) if att.fwd.executed else 0.0

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", _Ev)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    att._autotune()
    assert att.fwd_plan == 1 and att.bwd_plan in (0, 1)
    att.forward(*_inputs()[:3])
    assert att.fwd.executed[-1] == 1  # runs the kept plan by index


def test_eager_and_fused_passes_agree_bitwise():
    q, k, v, _ = _inputs()
    v = v * 1000
    a, b = cudnn_fp8._quantize_eager(q, k, v), cudnn_fp8._quantize_fused(q, k, v)
    assert all(cudnn_fp8._same(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(a[-1], 1 / a[5])  # scale_o is V's scale
    pairs = (a[0], a[1], a[4], a[5])
    assert all(torch.equal(x, y) for x, y in zip(cudnn_fp8._to_bf16_eager(*pairs), cudnn_fp8._to_bf16_fused(*pairs),
                                                 strict=True))


@pytest.mark.parametrize("require_amax", [1, 2])
def test_direct_call_binds_every_graph_tensor(monkeypatch, require_amax):
    monkeypatch.setitem(sys.modules, "cudnn", _fake_cudnn(require_amax))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(cuda_stream=0))
    d = cudnn_direct.Direct(2, 64, 4, 2, 32, 0.125, bwd=True, fused=False, device="cpu")
    assert d.amax_s == (require_amax == 2)
    q, k, v, do = _inputs()
    out, (dq, dk, dv) = d.fwdbwd(q, k, v, do)
    assert out.shape == q.shape and dk.shape == k.shape and dq.dtype == torch.bfloat16
    assert d.fwd.executed == [None] and d.bwd.executed == [None]
    # the direct quantizer and the wrapper's give the same operands
    ours = cudnn_fp8._quantize_eager(q, k, v)
    assert all(cudnn_fp8._same(x, y) for x, y in zip(cudnn_direct.quantize_qkv(q, k, v), ours, strict=True))
