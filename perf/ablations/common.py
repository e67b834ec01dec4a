"""What the ablation scripts share: inputs on the GPU, the backward kernel launched alone, timing with
the SM clock sampled, tile-step counts, the compile cache's switch and the compile-only SASS counts.

An ablation patches Python functions that the kernel calls while it is traced, so each build must
compile afresh: the in-memory cache is cleared at every patch and the disk cache is off while any
patch is active (a patched build stored under the real kernel's key would replace the real kernel
in later runs). Unpatched builds may use the disk cache unless FLAMIA_CUTE_DISK_CACHE=0 was set.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, HEAD_DIM = 16, 128
GO_WORKLOADS = ("1x16k", "1x64k")  # issue 36's go/no-go workloads
_DISK_ALLOWED = os.environ.get("FLAMIA_CUTE_DISK_CACHE", "1") != "0"

# SASS instructions the compile-only summaries count (flamia_cute.kernels.SASS_COUNTERS' wgmma and
# barrier rows, and the shared-memory and TMA stores the dQ path issues)
SASS_COUNTS = {
    "QGMMA": r"\bQGMMA\b",
    "HGMMA": r"\bHGMMA\b",
    # empty wgmma commit groups: ptxas issues a null HGMMA.64x8x16 (RZ operands) for each
    "null GMMA": r"GMMA\.\S+ RZ, gdesc\[URZ\]",
    "BAR": r"\bBAR\.",
    "STS": r"\bSTS\b",
    "UTMAREDG": r"\bUTMAREDG\b",
    "MUFU.EX2": r"\bMUFU\.EX2\b",
}


def set_patched(active: bool) -> None:
    """The disk cache off while a patch is active; clears the in-memory cache so the next call compiles."""
    from flamia_cute.compile_cache import clear_memory_cache

    os.environ["FLAMIA_CUTE_DISK_CACHE"] = "1" if (_DISK_ALLOWED and not active) else "0"
    clear_memory_cache()


def workloads() -> dict:
    import json

    from flamia_cute.bench import DEFAULT_WORKLOADS

    return json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]


class Inputs:
    """One workload at 16 heads, d128 on the GPU: q, k, v, dO, their quantized operands (the forward's
    layouts, the shipping tokenblock recipe), the real forward's O and LSE, and the backward's
    preprocessed dO, D, dV fold references and Q's bf16 copy (so the backward kernel runs alone)."""

    def __init__(self, name: str, lengths):
        import math

        import torch

        from flamia_cute.cute_backend import quantize_operands
        from flamia_cute.sm90.attention_fwd import FwdConfig, flamia_fwd_sm90
        from flamia_cute.sm90.bwd_preprocess import preprocess_bwd
        from flamia_cute.sm90.codes import e4m3_codes_to_bf16
        from flamia_cute.testing import cu_seqlens_from_lengths

        self.name, self.lengths = name, list(lengths)
        self.T, self.max_len = sum(self.lengths), max(self.lengths)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        self.cu = cu_seqlens_from_lengths(self.lengths, "cuda")
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, self.dout = (torch.randn(self.T, HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
                              for _ in range(4))
        self.ops = quantize_operands(q, k, v, self.cu, 128, self.max_len)
        self.fwd_config = FwdConfig(HEAD_DIM, diagonal_copy=True)
        self.out, self.lse = self.forward(self.fwd_config, flamia_fwd_sm90)
        self.delta, self.doq, self.dv_ref = preprocess_bwd(self.dout, self.out, self.cu, dv_ref_group=1)
        qq = self.ops[0]
        self.q_bf16 = e4m3_codes_to_bf16(qq.data_td, qq.scale)
        torch.cuda.synchronize()

    def forward(self, config, fwd_fn=None):
        """The forward kernel (its host wrapper: two allocations and the tile counter's 4-byte memset)."""
        if fwd_fn is None:
            from flamia_cute.sm90.attention_fwd import flamia_fwd_sm90 as fwd_fn
        qq, (kq, kt), (vq, vt) = self.ops
        return fwd_fn(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td, kt.scale,
                      vt.data_dt, vt.scale, self.cu, self.max_len, self.scale, config)

    def backward_config(self):
        """The untuned plan's backward config (make_plan without tuned records)."""
        from flamia_cute.sm90.attention_bwd import BwdDsBf16Config, auto_head_window

        return BwdDsBf16Config(HEAD_DIM, diagonal_copy=True, head_window=auto_head_window(HEADS, self.max_len))

    def backward_kernel(self, config):
        """A callable launching the backward kernel alone, as flamia_bwd_dsbf16_sm90 launches it, into
        outputs allocated once: no dO preprocess, no Q copy, no dQ zero fill or conversion. The dQ
        accumulator is never zeroed (timing only). The launcher is looked up at each call, so a
        patch followed by a call compiles the patched build."""
        import torch

        import flamia_cute.sm90.attention_bwd as bwd
        from flamia_cute.compile_cache import launch_on_device
        from flamia_cute.quant import transposed_tokens
        from flamia_cute.sm90.bwd_preprocess import backward_grid_blocks, backward_outputs

        qq, (kq, kt), (vq, vt) = self.ops
        T, H, D = qq.data_td.shape
        Hk = kq.data_td.shape[1]
        num_docs = self.cu.numel() - 1
        T_dt = transposed_tokens(T, num_docs)
        max_n_blocks = backward_grid_blocks(T, H, D, T_dt, num_docs, self.max_len, bwd.KEY_BLOCK)
        dq_acc, dk, dv = backward_outputs(T, H, Hk, D, qq.data_td.device)
        keep = (qq.data_td, self.q_bf16, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale, kt.data_td, kt.scale,
                vt.data_dt, vt.scale, self.doq.data_td, self.doq.data_dt, self.doq.scale, self.lse, self.delta,
                self.dv_ref, self.cu, dq_acc, dk, dv)
        assert not config.deterministic, "the deterministic build needs its semaphores"
        # no semaphores, no cos/sin tables (1 row); the separate-keys arguments as self-attention passes them
        args = (*(t.data_ptr() for t in keep), 0, 0, 0, T, T_dt, Hk, num_docs, max_n_blocks, 1, float(self.scale),
                self.cu.data_ptr(), self.cu.data_ptr(), T, T_dt)
        assert len(args) == len(bwd.ARG_KINDS) - 1, "attention_bwd.ARG_KINDS changed: update backward_kernel"
        dev = qq.data_td.device

        def run(keep=keep):
            launch_on_device(bwd.get_launcher(config), dev, *args)
        run()  # compiles (outside any timing)
        torch.cuda.synchronize()
        return run


def fwd_steps(lengths, heads: int = HEADS) -> int:
    """The forward's tile steps: (128-query, 128-key) tile pairs on or below the diagonal, per head."""
    return heads * sum(nb * (nb + 1) // 2 for nb in ((n + 127) // 128 for n in lengths))


def bwd_steps(lengths, heads: int = HEADS) -> int:
    """The backward's tile steps: (64-query, 128-key) tiles of every key block's CTA, per query head
    (key block n of a document of n_q 64-query tiles runs its tiles 2n .. n_q - 1)."""
    total = 0
    for n in lengths:
        n_q = (n + 63) // 64
        total += sum(n_q - 2 * blk for blk in range((n + 127) // 128))
    return heads * total


# ------------------------------------------------------------------------------------------------
# timing with the SM clock
# ------------------------------------------------------------------------------------------------


class ClockSampler:
    """nvidia-smi sampling the SM clock, power and clock-event reasons every 50 ms into a temporary
    csv while it runs; window(t0, t1) summarizes the rows between two time.time() stamps. Without
    nvidia-smi, window() reads torch.cuda.clock_rate() once (the clock now, not the window's)."""

    FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits",
                                          "-lms", "50"], stdout=self.log, stderr=subprocess.STDOUT)
            time.sleep(1.0)
        except OSError:
            self.proc = None
        self.sampled = self.proc is not None  # stays True after stop(): the rows stay readable

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None

    def window(self, t0: float, t1: float) -> dict:
        rows = []
        if self.sampled:
            self.log.flush()
            self.log.seek(0)
            for line in self.log.read().splitlines():
                parts = [p.strip() for p in line.split(",")]
                try:
                    stamp = parts[0].split(".")
                    ts = time.mktime(time.strptime(stamp[0], "%Y/%m/%d %H:%M:%S"))
                    ts += float("0." + stamp[1]) if len(stamp) > 1 else 0.0
                    rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
                except (ValueError, IndexError):
                    pass
        win = [r for r in rows if t0 <= r[0] <= t1]
        if not win:
            try:
                import torch

                return {"samples": 0, "sm_mhz": float(torch.cuda.clock_rate())}
            except Exception:
                return {"samples": 0, "sm_mhz": None}
        return {"samples": len(win), "sm_mhz": statistics.median(r[1] for r in win),
                "sm_mhz_min": min(r[1] for r in win), "power_w": round(statistics.median(r[2] for r in win), 1),
                "temp_c_max": max(r[3] for r in win), "clock_event_reasons": sorted({r[4] for r in win})}


def timed(run, sampler: ClockSampler | None = None) -> dict:
    """Burst GPU time of run() (bench_fwd_breakdown.graph_ms: a CUDA graph of 10 calls replayed 7
    times, the median) with the SM clock over the replays. One call first, outside the clock's window:
    a patched build compiles there (seconds of an idle GPU)."""
    import torch
    from bench_fwd_breakdown import graph_ms

    run()
    torch.cuda.synchronize()
    t0 = time.time()
    ms = graph_ms(run)
    t1 = time.time()
    return {"ms": ms, **(sampler.window(t0, t1) if sampler is not None else {})}


def cycles_per_step(ms: float, mhz: float | None, steps: int) -> float | None:
    """SM cycles per tile step: the time times the SM clock times the SMs (one CTA per SM), over the
    steps (fwd_steps / bwd_steps)."""
    if not mhz or not steps:
        return None
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return ms * 1e-3 * mhz * 1e6 * sms / steps


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """rows as a markdown table; columns: (key, header). Floats to 4 significant digits."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    print("| " + " | ".join(h for _, h in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |", flush=True)


# ------------------------------------------------------------------------------------------------
# compile only
# ------------------------------------------------------------------------------------------------


def sass_counts(art) -> dict:
    """Registers, stack frame and SASS_COUNTS of a kernel_artifacts() result (SASS needs nvdisasm)."""
    out = {"registers": art.registers, "stack_bytes": art.frame_bytes}
    if art.sass is None:
        out["sass"] = "no nvdisasm"
        return out
    for label, pat in SASS_COUNTS.items():
        out[label] = len(re.findall(pat, art.sass))
    return out


def compile_builds(kernel_module, cfg, ablations: dict, patch, changed) -> dict:
    """Each ablation's build of `cfg` for sm_90a on the CPU (no GPU): its registers, stack and SASS counts,
    and what the patches changed while it was traced (`changed`, a Counter the patches fill)."""
    print(f"builds of {cfg}, sm_90a")
    out = {}
    try:
        for label, flags in ablations.items():
            patch(**flags)
            counts = sass_counts(kernel_module.kernel_artifacts(cfg, "sm_90a"))
            out[label] = counts
            print(f"  {label:22s} {counts}  changed while traced: {dict(changed) or '-'}", flush=True)
    finally:
        patch()
    return out


def parser(doc: str, go_help: str):
    """The two scripts' shared arguments."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", help="names in flamia_cute/workloads.json (default 1x16k 4x4k 16x1k; "
                                                 "--go: 1x16k 1x64k)")
    ap.add_argument("--go", action="store_true", help=go_help)
    ap.add_argument("--compile-only", action="store_true", help="build each ablation for sm_90a (no GPU): SASS counts")
    return ap


def selection(args, all_ablations: dict, go: tuple, chosen, compile_only):
    """(ablations, workload names) for a timing run; (None, None) after a --compile-only run."""
    ablations = {k: all_ablations[k] for k in go} if args.go else chosen(args.ablations)
    if args.compile_only:
        compile_only(ablations)
        return None, None
    return ablations, args.workloads or (list(GO_WORKLOADS) if args.go else ["1x16k", "4x4k", "16x1k"])
