"""cuDNN's FP8 attention (cudnn-frontend sdpa_fp8 / sdpa_fp8_backward), per-tensor current scaling.

Equal-length batches only (its Hopper backward rejects packed layouts), BSHD layout, e4m3 inputs
and outputs (Hopper's sdpa_fp8 writes O in FP8 only), run as a user's best direct call: the graphs
built once per shape with the fastest of their execution plans (timed once, autotune), no outputs
requested that nothing reads, per-tensor scales for Q, K, V (and dO) from their amax (power-of-two
scales: the casts are exact up to e4m3's rounding), O's scale V's (|O| <= max|V|), and every
per-call pass fused: one pass for the three amaxes (and one for the three casts) where inductor
fuses them, one conversion of the FP8 output(s) to bf16. All of it is in the timings. No host
syncs, no allocation but the outputs, torch's current stream: a CUDA graph captures it.

FUSION says which per-call passes ran: "inductor" (torch.compile) or "eager" (the same passes as
single torch ops where torch.compile does not work here: one extra pass for each conversion).
"""

from __future__ import annotations

import math
import warnings

import torch

E4M3_MAX = 448.0
F8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- the per-call passes


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales that map each amax under 448 (on device, no sync); amax fp32."""
    return torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(1e-12))))


def _quantize_fused(*xs):
    """(x_fp8, descale (1,1,1,1) fp32) for each x, then scale_o (V's scale, the last x's), for
    torch.compile: inductor fuses the amaxes into one reduction pass and the casts into one pass."""
    amax = torch.stack([x.abs().amax().float() for x in xs])
    scale = _scales(amax)
    out = []
    for i, x in enumerate(xs):
        out += [(x * scale[i].to(x.dtype)).to(F8), (1.0 / scale[i]).reshape(1, 1, 1, 1)]
    return (*out, scale[-1].reshape(1, 1, 1, 1))


def _quantize_eager(*xs):
    """_quantize_fused as single torch ops: one max|x| pass per input (no |x| copy), one scale
    computation for all, one multiply-and-cast pass per input (written straight into the FP8 output
    where torch casts on store)."""
    amax = torch.stack([torch.linalg.vector_norm(x, float("inf")) for x in xs]).float()
    scale = _scales(amax)
    descale = (1.0 / scale).reshape(-1, 1, 1, 1, 1)
    scale_x = scale.to(xs[0].dtype)
    out = []
    for i, x in enumerate(xs):
        out += [_mul_to_f8(x, scale_x[i]), descale[i]]
    return (*out, scale[-1].reshape(1, 1, 1, 1))


_CAST_ON_STORE: list[bool] = []


def _mul_to_f8(x, s):
    if _CAST_ON_STORE != [False]:
        try:
            x8 = torch.empty(x.shape, dtype=F8, device=x.device)
            torch.mul(x, s, out=x8)
            _CAST_ON_STORE[:] = [True]
            return x8
        except RuntimeError:  # this torch cannot cast to FP8 on store: two passes
            _CAST_ON_STORE[:] = [False]
    return (x * s).to(F8)


def _to_bf16_fused(*pairs):
    """Each (x_fp8, descale) to bf16 in one pass (descale: a power of two: exact)."""
    return tuple((x.float() * d).to(torch.bfloat16) for x, d in zip(pairs[0::2], pairs[1::2], strict=True))


def _to_bf16_eager(*pairs):
    out = []
    for x, d in zip(pairs[0::2], pairs[1::2], strict=True):
        y = x.to(torch.bfloat16)
        out.append(y.mul_(d.to(torch.bfloat16)))
    return tuple(out)


# "inductor" once a compiled pass ran and matched the eager one bitwise; "eager" (and why) once one did not
FUSION = {"mode": None, "why": ""}
_COMPILED: dict[tuple, object] = {}


def _fresh(fn):
    """fn with a code object of its own: torch.compile caches (and limits recompiles) per code object,
    and each call signature here gets its own compile, however many shapes a benchmark runs."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == F8 else torch.equal(a, b)


def _run(fused, eager, args):
    """fused(*args) compiled once per signature (checked bitwise against eager on its first call), or
    eager(*args) for good once torch.compile fails here, with one warning that says why."""
    if FUSION["mode"] == "eager":
        return eager(*args)
    key = (fused.__name__, tuple((tuple(a.shape), a.dtype, a.device) for a in args))
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn(*args)
    try:
        fn = torch.compile(_fresh(fused), dynamic=False, fullgraph=True)
        got, want = fn(*args), eager(*args)
        if not all(_same(a, b) for a, b in zip(got, want, strict=True)):
            raise RuntimeError(f"the compiled {fused.__name__} differs from the eager passes")
    except Exception as e:  # no working inductor here: the eager passes, said once
        FUSION.update(mode="eager", why=f"{type(e).__name__}: {e}"[:300])
        warnings.warn(f"cuDNN FP8 baseline: torch.compile does not work here ({FUSION['why']}); its quantization "
                      "and conversions run as eager torch ops (an extra pass for each conversion)", stacklevel=3)
        return eager(*args)
    FUSION["mode"] = "inductor"
    _COMPILED[key] = fn
    return got


def quantize(*xs):
    """(x_fp8, descale) per x, then scale_o (the last x's scale): the per-tensor current scaling of a call."""
    return _run(_quantize_fused, _quantize_eager, xs)


def to_bf16(*pairs):
    """bf16 copies of FP8 outputs: to_bf16(x8, descale, y8, descale, ...) -> (x, y, ...)."""
    return _run(_to_bf16_fused, _to_bf16_eager, pairs)


# ----------------------------------------------------------------------------- the graphs

AUTOTUNE_REPS = 5


def _build_plans(cudnn, g) -> None:
    """Every plan the heuristics list (the autotune picks among them); the heuristics' choice alone
    where building them all is not possible here."""
    try:
        g.build_plans(cudnn.build_plan_policy.ALL)
    except Exception:
        g.build_plans()


class CudnnFp8Attention:
    """Forward and backward graphs for one (batch, heads, seqlen, head_dim) shape."""

    def __init__(self, b: int, hq: int, hkv: int, s: int, d: int, softmax_scale: float, autotune: bool = True,
                 device="cuda"):
        import cudnn

        self.cudnn = cudnn
        self.shape = (b, hq, hkv, s, d)
        self.softmax_scale = softmax_scale
        self.device = torch.device(device)
        self.handle = cudnn.create_handle()

        def scalar(x):
            return torch.full((1, 1, 1, 1), x, device=self.device)

        # P in [0,1]: scale_s 448 -> 256 (power of two). dP and the gradients: fixed scales sized for
        # unit-variance inputs (cuDNN's users pass delayed scales)
        self.scale_s, self.descale_s = scalar(256.0), scalar(1 / 256.0)
        self.scale_dp, self.descale_dp, self.scale_g, self.descale_g = (scalar(2.0**4), scalar(2.0**-4),
                                                                        scalar(2.0**4), scalar(2.0**-4))
        self.fwd, self.ft, self.fwd_amax = self._build(self._fwd_graph)
        self.bwd, self.bt, self.bwd_amax = self._build(self._bwd_graph)
        self.amax_bufs = {name: scalar(0.0) for name in (*self.fwd_amax, *self.bwd_amax)}
        self.fwd_plan = self.bwd_plan = None
        ws = max(self._ws(self.fwd), self._ws(self.bwd))
        self.ws = torch.empty(ws, dtype=torch.uint8, device=self.device)
        if autotune:
            self._autotune()

    # ---- building

    def _bshd(self, g, name, h, dtype):
        b, _, _, s, d = self.shape
        return g.tensor(name=name, dim=(b, h, s, d), stride=(s * h * d, d, h * d, 1), data_type=dtype)

    def _scalar(self, g, name):
        return g.tensor(name=name, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=self.cudnn.data_type.FLOAT)

    def _out(self, t, dims, strides, dtype):
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(dtype)

    def _new_graph(self):
        c = self.cudnn
        return c.pygraph(io_data_type=c.data_type.FP8_E4M3, intermediate_data_type=c.data_type.FLOAT,
                         compute_data_type=c.data_type.FLOAT)

    def _build(self, make):
        """make(graph, amax_outputs) -> tensors: the graph built with as few amax outputs as this cuDNN
        accepts (none is read: each is an extra reduction in the kernel), all its plans built."""
        c = self.cudnn
        errors = []
        for amax in ("none", "o", "all"):
            g = self._new_graph()
            try:
                t, amax_names = make(g, amax)
                g.validate()
                g.build_operation_graph()
                g.create_execution_plans([c.heur_mode.A, c.heur_mode.FALLBACK])
                g.check_support()
                _build_plans(c, g)
                return g, t, amax_names
            except Exception as e:  # this cuDNN wants the amax outputs declared: the next variant
                errors.append(f"amax {amax}: {type(e).__name__}: {e}"[:300])
        raise RuntimeError("cuDNN FP8 graph: no variant builds: " + " | ".join(errors))

    def _fwd_graph(self, g, amax: str):
        c = self.cudnn
        b, hq, hkv, s, d = self.shape
        fp8, f32 = c.data_type.FP8_E4M3, c.data_type.FLOAT
        t = {"q": self._bshd(g, "q", hq, fp8), "k": self._bshd(g, "k", hkv, fp8), "v": self._bshd(g, "v", hkv, fp8)}
        for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
            t[n] = self._scalar(g, n)
        o, stats, amax_s, amax_o = g.sdpa_fp8(
            q=t["q"], k=t["k"], v=t["v"], descale_q=t["descale_q"], descale_k=t["descale_k"],
            descale_v=t["descale_v"], descale_s=t["descale_s"], scale_s=t["scale_s"], scale_o=t["scale_o"],
            generate_stats=True, attn_scale=self.softmax_scale, use_causal_mask=True)
        self._out(o, (b, hq, s, d), (s * hq * d, d, hq * d, 1), fp8)
        self._out(stats, (b, hq, s, 1), (s * hq, s, 1, 1), f32)
        names = {"none": (), "o": ("amax_o",), "all": ("amax_s", "amax_o")}[amax]
        for n, a in (("amax_s", amax_s), ("amax_o", amax_o)):
            if n in names:
                self._out(a, (1, 1, 1, 1), (1, 1, 1, 1), f32)
                t[n] = a
        return t | {"o": o, "stats": stats}, names

    def _bwd_graph(self, g, amax: str):
        c = self.cudnn
        b, hq, hkv, s, d = self.shape
        fp8, f32 = c.data_type.FP8_E4M3, c.data_type.FLOAT
        t = {n: self._bshd(g, n, h, fp8) for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("o", hq), ("dO", hq))}
        t["stats"] = g.tensor(name="stats", dim=(b, hq, s, 1), stride=(s * hq, s, 1, 1), data_type=f32)
        names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                 "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
        for n in names:
            t[n] = self._scalar(g, n)
        dq, dk, dv, *amaxes = g.sdpa_fp8_backward(
            q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"],
            **{n: t[n] for n in names}, attn_scale=self.softmax_scale, use_causal_mask=True)
        self._out(dq, (b, hq, s, d), (s * hq * d, d, hq * d, 1), fp8)
        for x in (dk, dv):
            self._out(x, (b, hkv, s, d), (s * hkv * d, d, hkv * d, 1), fp8)
        amax_names = () if amax == "none" else ("amax_dq", "amax_dk", "amax_dv", "amax_dp")
        for n, a in zip(amax_names, amaxes, strict=False):
            self._out(a, (1, 1, 1, 1), (1, 1, 1, 1), f32)
            t[n] = a
        return t | {"dq": dq, "dk": dk, "dv": dv}, amax_names

    def _ws(self, g) -> int:
        sizes = [g.get_workspace_size()]
        if hasattr(g, "get_execution_plan_count") and hasattr(g, "get_workspace_size_plan_at_index"):
            for i in range(g.get_execution_plan_count()):
                try:
                    sizes.append(g.get_workspace_size_plan_at_index(i))
                except Exception:  # a plan that did not build
                    pass
        return max(1, *sizes)

    # ---- running

    def _execute(self, graph, plan, pack):
        # on torch's current stream: ordered with the quantization and captured by CUDA graphs
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        if plan is None:
            graph.execute(pack, self.ws, handle=self.handle)
        else:
            graph.execute_plan_at_index(pack, self.ws, plan, handle=self.handle)

    def _autotune(self):
        """The fastest plan of each graph, timed on random inputs (AUTOTUNE_REPS calls each); None (the
        heuristics' first) where this cudnn-frontend cannot run a plan by index."""
        g = self.fwd
        if not (hasattr(g, "get_execution_plan_count") and hasattr(g, "execute_plan_at_index")):
            return
        b, hq, hkv, s, d = self.shape
        mk = lambda h: torch.randn(b, s, h, d, device=self.device, dtype=torch.bfloat16)
        q, k, v, do = mk(hq), mk(hkv), mk(hkv), mk(hq)
        fpack, o, stats, saved = self._fwd_pack(q, k, v)
        bpack, _ = self._bwd_pack(do, o, saved[5], stats, saved)
        self.fwd_plan = self._fastest(self.fwd, fpack)
        self.bwd_plan = self._fastest(self.bwd, bpack)

    def _fastest(self, graph, pack):
        times = {}
        for i in range(graph.get_execution_plan_count()):
            try:
                self._execute(graph, i, pack)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(AUTOTUNE_REPS):
                    self._execute(graph, i, pack)
                b.record()
                b.synchronize()
                times[i] = a.elapsed_time(b)
            except Exception:  # a plan that does not run here
                continue
        return min(times, key=times.get) if times else None

    def _fwd_pack(self, q, k, v):
        b, hq, hkv, s, d = self.shape
        q8, dq_, k8, dk_, v8, dv_, scale_o = quantize(q, k, v)
        o = torch.empty(b, s, hq, d, dtype=F8, device=q.device)
        stats = torch.empty(b, hq, s, 1, dtype=torch.float32, device=q.device)
        ft = self.ft
        pack = {ft["q"]: q8, ft["k"]: k8, ft["v"]: v8, ft["descale_q"]: dq_, ft["descale_k"]: dk_,
                ft["descale_v"]: dv_, ft["descale_s"]: self.descale_s, ft["scale_s"]: self.scale_s,
                ft["scale_o"]: scale_o, ft["o"]: o, ft["stats"]: stats}
        for n in self.fwd_amax:
            pack[ft[n]] = self.amax_bufs[n]
        # O's descale is V's (scale_o = V's scale)
        return pack, o, stats, (q8, k8, v8, dq_, dk_, dv_)

    def forward(self, q, k, v):
        """q, k, v: (b, s, h, d) bf16. Returns (o fp8, descale_o, stats, saved)."""
        pack, o, stats, saved = self._fwd_pack(q, k, v)
        self._execute(self.fwd, self.fwd_plan, pack)
        return o, saved[5], stats, saved

    def forward_bf16(self, q, k, v):
        """O in bf16, as its consumer takes it (what `flamia-cute bench` times), and what backward needs."""
        o, desc, stats, saved = self.forward(q, k, v)
        (out,) = to_bf16(o, desc)
        return out, (o, desc, stats, saved)

    def _bwd_pack(self, dout, o, descale_o, stats, saved):
        b, hq, hkv, s, d = self.shape
        q8, k8, v8, dq_, dk_, dv_ = saved
        do8, ddo, _ = quantize(dout)
        dq = torch.empty(b, s, hq, d, dtype=F8, device=dout.device)
        dk = torch.empty(b, s, hkv, d, dtype=F8, device=dout.device)
        dv = torch.empty_like(dk)
        bt, g = self.bt, self.scale_g
        pack = {bt["q"]: q8, bt["k"]: k8, bt["v"]: v8, bt["o"]: o, bt["dO"]: do8, bt["stats"]: stats,
                bt["descale_q"]: dq_, bt["descale_k"]: dk_, bt["descale_v"]: dv_, bt["descale_o"]: descale_o,
                bt["descale_dO"]: ddo, bt["descale_s"]: self.descale_s, bt["descale_dP"]: self.descale_dp,
                bt["scale_s"]: self.scale_s, bt["scale_dQ"]: g, bt["scale_dK"]: g, bt["scale_dV"]: g,
                bt["scale_dP"]: self.scale_dp, bt["dq"]: dq, bt["dk"]: dk, bt["dv"]: dv}
        for n in self.bwd_amax:
            pack[bt[n]] = self.amax_bufs[n]
        return pack, (dq, dk, dv)

    def backward(self, dout, o, descale_o, stats, saved):
        """dq, dk, dv in bf16 (one conversion pass for the three)."""
        pack, (dq, dk, dv) = self._bwd_pack(dout, o, descale_o, stats, saved)
        self._execute(self.bwd, self.bwd_plan, pack)
        g = self.descale_g
        return to_bf16(dq, g, dk, g, dv, g)


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)
