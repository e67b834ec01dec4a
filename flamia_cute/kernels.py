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
}
PTX_COUNTERS = {
    "wgmma e4m3": r"wgmma\.mma_async[^\n]*e4m3",
    "wgmma bf16": r"wgmma\.mma_async[^\n]*bf16",
    "cp.async.bulk.tensor": r"cp\.async\.bulk\.tensor",
    "cvt e4m3x2": r"cvt\.rn\.satfinite\.e4m3x2\.f32",
    "tcgen05.mma": r"tcgen05\.mma",
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

    def artifacts(self, config, arch: str):
        import importlib

        return importlib.import_module(self.module).kernel_artifacts(config, arch)


# The forward and the backward share their named configs (recipe x head dim x GQA group).
ATTENTION_CONFIGS = {
    "token_d128": dict(head_dim=128),
    "tokenblock_d128": dict(head_dim=128, diagonal_copy=True),
    "tokenblock_d64": dict(head_dim=64, diagonal_copy=True),
    "tokenblock_d128_gqa4": dict(head_dim=128, diagonal_copy=True, qhead_per_kvhead=4),
}

KERNELS = {
    k.name: k
    for k in (
        KernelEntry("quantize", ("sm_90a",), "flamia_cute.quantize_sm90", "QuantizeConfig", {
            "token_d128": dict(head_dim=128, num_heads=16, block_tokens=1),
            "tokenblock_d128": dict(head_dim=128, num_heads=16, block_tokens=128, emit_token_copy=True),
            "tokenblock_d64": dict(head_dim=64, num_heads=32, block_tokens=128, emit_token_copy=True),
            "tokenblock_d256": dict(head_dim=256, num_heads=8, block_tokens=128, emit_token_copy=True),
            "dout_delta_d128": dict(head_dim=128, num_heads=16, block_tokens=1, dt_pv_order=True, emit_rowdot=True),
        }),
        KernelEntry("fwd", ("sm_90a",), "flamia_cute.attention_fwd_sm90", "FwdConfig", ATTENTION_CONFIGS),
        KernelEntry("bwd", ("sm_90a",), "flamia_cute.attention_bwd_sm90", "BwdConfig", ATTENTION_CONFIGS),
        # the bf16-dS backward (recipe fp8_tokenblock_dsbf16)
        KernelEntry("bwd_dsbf16", ("sm_90a",), "flamia_cute.attention_bwd_dsbf16_sm90", "BwdDsBf16Config",
                    ATTENTION_CONFIGS),
    )
}


def set_target_arch(arch: str) -> None:
    """Must run before cutlass is imported: the DSL fixes its arch at import."""
    os.environ["FLAMIA_ARCH"] = arch
    os.environ["CUTE_DSL_ARCH"] = arch


def summarize(art: Any, smem_bytes: int) -> dict:
    out = {"arch": art.arch, "registers": art.registers, "stack_frame_bytes": art.frame_bytes,
           "shared_memory_bytes": smem_bytes}
    for label, pat in PTX_COUNTERS.items():
        out[f"ptx {label}"] = len(re.findall(pat, art.ptx))
    if art.sass:
        for label, pat in SASS_COUNTERS.items():
            out[f"sass {label}"] = len(re.findall(pat, art.sass))
    return out
