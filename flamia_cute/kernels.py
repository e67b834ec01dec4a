"""Registry of the CuTe DSL kernels: named configs for `flamia-cute ptx` and the compile-only tests."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

# What to count in the generated code, so a user sees at a glance that the FP8 path is what runs.
SASS_COUNTERS = {
    "QGMMA (fp8 wgmma)": r"\bQGMMA\b",
    "HGMMA (16-bit wgmma)": r"\bHGMMA\b",
    "UTMALDG (TMA load)": r"\bUTMALDG\b",
    "UTMASTG (TMA store)": r"\bUTMASTG\b",
    "MUFU.EX2": r"\bMUFU\.EX2\b",
    "F2FP e4m3 pack": r"\bF2FP\.SATFINITE\.E4M3",
    "BAR (named barriers)": r"\bBAR\.",
    "LDG.128": r"\bLDG\.E\.128\b",
    "STG.128": r"\bSTG\.E\.128\b",
    "STL/LDL (local memory)": r"\b(STL|LDL)\b",
    "tcgen05 (UTC*)": r"\bUTC\w+",
    "UTCQMMA (fp8 tcgen05)": r"\bUTCQMMA\b",
    "UTCHMMA (16-bit tcgen05)": r"\bUTCHMMA\b",
}
PTX_COUNTERS = {
    "wgmma e4m3": r"wgmma\.mma_async[^\n]*e4m3",
    "wgmma bf16": r"wgmma\.mma_async[^\n]*bf16",
    "cp.async.bulk.tensor": r"cp\.async\.bulk\.tensor",
    "cvt e4m3x2": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
    "tcgen05.mma": r"tcgen05\.mma",
    "tcgen05.mma block_scale": r"tcgen05\.mma[^\n]*block_scale",
    ".local": r"\.local\b",
}


@dataclass(frozen=True)
class KernelEntry:
    name: str
    arches: tuple[str, ...]
    module: str  # imported lazily: the DSL fixes its arch at import
    config_class: str
    configs: dict[str, dict]  # named configs: field overrides

    def config(self, config_name: str, overrides: dict | None = None):
        import importlib

        if config_name not in self.configs:
            raise ValueError(f"--config: kernel {self.name!r} has configs {sorted(self.configs)}, not {config_name!r}")
        cls = getattr(importlib.import_module(self.module), self.config_class)
        fields = {f.name for f in dataclasses.fields(cls)}
        bad = set(overrides or {}) - fields
        if bad:
            raise ValueError(f"--set: {sorted(bad)} are not fields of {cls.__name__} ({sorted(fields)})")
        return cls(**(self.configs[config_name] | (overrides or {})))

    def smem_bytes(self, config) -> int:
        """Shared memory per CTA the config asks for at launch (dynamic: not in the cubin)."""
        import importlib

        return int(importlib.import_module(self.module).smem_bytes(config))

    def tmem_columns(self, config) -> int | None:
        """Tensor-memory columns the config uses, for kernels that allocate tensor memory (else None)."""
        import importlib

        fn = getattr(importlib.import_module(self.module), "tmem_columns", None)
        return None if fn is None else int(fn(config))

    def artifacts(self, config, arch: str):
        import importlib

        return importlib.import_module(self.module).kernel_artifacts(config, arch)


# The forward and the backward share their named configs (recipe x head dim x GQA group).
ATTENTION_CONFIGS = {
    "token_d128": dict(head_dim=128),
    "tokenblock_d128": dict(head_dim=128, diagonal_copy=True),
    "tokenblock_d64": dict(head_dim=64, diagonal_copy=True),
    "tokenblock_d128_gqa4": dict(head_dim=128, diagonal_copy=True, qhead_per_kvhead=4),
    # queries that are the last positions of their document's keys, and causal=False (cu_seqlens_k)
    "tokenblock_d128_cross": dict(head_dim=128, diagonal_copy=True, cross_length=True),
    "tokenblock_d128_noncausal": dict(head_dim=128, diagonal_copy=True, causal=False),
}

# B200 and B300: the Blackwell kernels build for both (the same tcgen05 code; per-CTA limits equal)
BLACKWELL_ARCHES = ("sm_100a", "sm_103a")

KERNELS = {
    k.name: k
    for k in (
        KernelEntry("quantize", ("sm_90a",), "flamia_cute.sm90.quantize", "QuantizeConfig", {
            "token_d128": dict(head_dim=128, num_heads=16, block_tokens=1),
            "tokenblock_d128": dict(head_dim=128, num_heads=16, block_tokens=128, emit_token_copy=True),
            "tokenblock_d64": dict(head_dim=64, num_heads=32, block_tokens=128, emit_token_copy=True),
            "tokenblock_d256": dict(head_dim=256, num_heads=8, block_tokens=128, emit_token_copy=True),
            "dout_delta_d128": dict(head_dim=128, num_heads=16, block_tokens=1, dt_pv_order=True, emit_rowdot=True),
            # Q/K rotations in the quantization (rotary.py; the Hadamard transform and interleaved RoPE
            # build at 3 CTAs per SM, sm90/quantize.HADAMARD_MIN_CTAS: tests/test_rotary.py), D from dO's codes
            "rope_tokenblock_d128": dict(head_dim=128, num_heads=16, block_tokens=128, emit_token_copy=True,
                                         rotary="half", rotary_dim=128),
            "rope_tokenblock_d64": dict(head_dim=64, num_heads=32, block_tokens=128, emit_token_copy=True,
                                        rotary="half", rotary_dim=64),
            "dout_delta_quantized_d128": dict(head_dim=128, num_heads=16, block_tokens=1, dt_pv_order=True,
                                              emit_rowdot=True, rowdot_quantized=True),
        }),
        KernelEntry("fwd", ("sm_90a",), "flamia_cute.sm90.attention_fwd", "FwdConfig", ATTENTION_CONFIGS),
        # the backward (bf16 dS: recipe fp8_tokenblock_dsbf16 and its per-token variant)
        KernelEntry("bwd_dsbf16", ("sm_90a",), "flamia_cute.sm90.attention_bwd", "BwdDsBf16Config",
                    ATTENTION_CONFIGS | {  # the dK epilogue with K's inverse rotations
                        "rope_hadamard_d128": dict(head_dim=128, diagonal_copy=True, rotary="half", rotary_dim=128,
                                                   hadamard=3)}),
        # the dQ conversion (fp32 -> bf16) with Q's inverse rotations
        KernelEntry("grad_rotate", ("sm_90a",), "flamia_cute.sm90.rotate", "GradRotateConfig", {
            "rope_hadamard_d128": dict(head_dim=128, rotary="half", rotary_dim=128, hadamard=4),
            "interleaved_d64": dict(head_dim=64, rotary="interleaved", rotary_dim=64),
        }),
        # Q's e4m3 codes as bf16 for the backward's dK operand
        KernelEntry("codes", ("sm_90a",), "flamia_cute.sm90.codes", "CodesConfig",
                    {"default": {}, "row_scale": dict(row_scale=True)}),
        # Blackwell: the MXFP8 forward on block-scaled tcgen05 (compile-only here: no sm_100 GPU)
        KernelEntry("fwd_mx", BLACKWELL_ARCHES, "flamia_cute.sm100.attention_fwd", "FwdSm100Config", {
            "mxfp8_d128": {}, "mxfp8_d128_gqa4": dict(qhead_per_kvhead=4),
        }),
        # its fused quantization: no tensor cores, so it also builds (and is GPU-tested) for sm_90a
        KernelEntry("quantize_mx", (*BLACKWELL_ARCHES, "sm_90a"), "flamia_cute.sm100.quantize_mx", "MxQuantizeConfig",
                    {"d128": {}}),
        # the planned MXFP8 backward's dO (both orientations) and D = rowsum(dO * O): also runs on sm_90a
        KernelEntry("quantize_do_mx", (*BLACKWELL_ARCHES, "sm_90a"), "flamia_cute.sm100.quantize_do_mx",
                    "MxDoQuantizeConfig", {"d128": {}}),
    )
}


def set_target_arch(arch: str) -> None:
    """Must run before cutlass is imported: the DSL fixes its arch at import."""
    os.environ["FLAMIA_ARCH"] = arch
    os.environ["CUTE_DSL_ARCH"] = arch


# Instructions that every lane of the warp (or every thread named by a barrier) must execute together.
_COLLECTIVE = re.compile(r"^\s*(elect\.sync|shfl\.sync|vote\.sync|match\.sync|redux\.sync|bar\.sync|bar\.arrive|"
                         r"barrier\.sync|barrier\.arrive|bar\.warp\.sync|wgmma\.|setmaxnreg)")
_REG = re.compile(r"%[a-z]+\d+")


def lane_divergent_collectives(ptx: str) -> list[str]:
    """Warp-collective instructions inside a forward branch taken or not by lane: a predicate computed
    (through any arithmetic) from %laneid guards `@%p bra L`, and a collective lies on the fall-through
    path before `L:`.
    Some lanes then execute it without the others: `elect.sync` with a full mask from lane 0 alone
    deadlocks the warp. Returns the offending lines."""
    lines = ptx.splitlines()
    lane_vals: set[str] = set()
    found = []
    for i, line in enumerate(lines):
        text = line.strip()
        if "%laneid" in text:
            lane_vals.update(_REG.findall(text.split(",")[0]))
            continue
        regs = _REG.findall(text)
        op = text.split()[0] if text else ""
        if regs and not _COLLECTIVE.match(text) and not op.startswith(("@", "bra", "st.", "ld.")):
            # destination first: lane-varying when any source is (shuffles and votes excluded above)
            if any(r in lane_vals for r in regs[1:]):
                lane_vals.add(regs[0])
        m = re.match(r"@!?(%p\d+)\s+bra(?:\.uni)?\s+(\$?[\w.]+);", text)
        if m and m.group(1) in lane_vals:
            target = m.group(2) + ":"
            for later in lines[i + 1:]:
                stripped = later.strip()
                if stripped == target or re.match(r"(bra(\.uni)?|ret|exit)\b", stripped):
                    break  # the label, or the end of the fall-through path
                if _COLLECTIVE.match(later):
                    found.append(f"{text} .. {stripped[:60]}")
    return found


def summarize(art: Any, smem_bytes: int, tmem_columns: int | None = None) -> dict:
    out = {"arch": art.arch, "registers": art.registers, "stack_frame_bytes": art.frame_bytes,
           "shared_memory_bytes": smem_bytes}
    if tmem_columns is not None:
        out["tensor_memory_columns"] = tmem_columns
    for label, pat in PTX_COUNTERS.items():
        out[f"ptx {label}"] = len(re.findall(pat, art.ptx))
    out["ptx collectives under a lane branch"] = len(lane_divergent_collectives(art.ptx))
    if art.sass:
        for label, pat in SASS_COUNTERS.items():
            out[f"sass {label}"] = len(re.findall(pat, art.sass))
    return out
