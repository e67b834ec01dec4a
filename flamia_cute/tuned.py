"""The tuned configs at run time: the per-GPU records `flamia-cute tune` writes, looked up by workload class.

The records are one JSON file per GPU under <cache dir>/tuning/, keyed by GPU name, SM count, CUDA
driver, DSL and package versions. A file written under other versions is stale: ignored with a
one-line warning, never used. A call looks its configs up by workload class (from max_seqlen and
the mean document length, both known on the host without a sync). This module imports neither the
tuner (tuning.py) nor the benchmark harness.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path


def workload_class(max_seqlen: int, total_tokens: int, num_docs: int) -> str:
    """Coarse class of a packed batch: what changes the best config (tile counts, per-document overheads)."""
    mean = total_tokens / max(num_docs, 1)
    size = "long" if max_seqlen >= 8192 else "mid" if max_seqlen >= 1024 else "short"
    spread = "uniform" if max_seqlen <= 2 * mean else "skewed"
    return f"{size}-{spread}"


@dataclass(frozen=True)
class TuningKey:
    gpu: str
    sm_count: int
    driver: str
    dsl: str
    package: str

    @classmethod
    def current(cls) -> TuningKey:
        import torch

        from .compile_cache import dsl_cuda_version, dsl_version
        from .version import __version__

        props = torch.cuda.get_device_properties(0)
        driver = ".".join(str(x) for x in torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") \
            else str(torch.version.cuda)
        # the DSL's CUDA 12 and 13 compilers build different SASS, so a config tuned under one may not win under the other
        return cls(props.name, props.multi_processor_count, driver, f"{dsl_version()}+cuda{dsl_cuda_version()}", __version__)

    def filename(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.gpu}_{self.sm_count}sm") + ".json"


def cache_path(key: TuningKey) -> Path:
    from .compile_cache import cache_dir

    return cache_dir() / "tuning" / key.filename()



AUTO_WINDOW = "auto"


def record_fields(kernel: str, cfg, heads_kv: int, max_seqlen: int) -> dict:
    """config_fields as a tuned record stores them: the bf16-dS head window as AUTO_WINDOW where it is
    the one auto_head_window picks for the tuned workload."""
    fields = config_fields(kernel, cfg)
    if kernel == "bwd_dsbf16":
        from .sm90.attention_bwd import auto_head_window

        if fields["head_window"] == auto_head_window(heads_kv, max_seqlen):
            fields["head_window"] = AUTO_WINDOW
    return fields


def config_fields(kernel: str, cfg) -> dict:
    """The fields the search varies, as the plain JSON dict the cache stores."""
    if kernel == "quant":
        return {"raster": cfg.raster, "min_ctas_per_sm": cfg.min_ctas_per_sm,
                "heads_per_cta": [p.heads_per_cta for p in cfg.parts]}
    names = {"fwd": ("kv_stages", "tile_order", "short_pairs"),
             "bwd_dsbf16": ("vec_stages", "head_window", "short_pairs")}
    return {n: getattr(cfg, n) for n in names[kernel]}


def config_from_fields(kernel: str, default, fields: dict):
    """`default` with the stored fields applied (inverse of config_fields)."""
    if kernel == "quant":
        fields = dict(fields)
        hgs = fields.pop("heads_per_cta")
        parts = tuple(dataclasses.replace(p, heads_per_cta=h) for p, h in zip(default.parts, hgs, strict=True))
        return dataclasses.replace(default, parts=parts, **fields)
    if kernel == "bwd_dsbf16" and fields.get("head_window") == AUTO_WINDOW:  # the call's own (by length)
        fields = {**fields, "head_window": default.head_window}
    return dataclasses.replace(default, **fields)


def fwd_shape(cfg) -> str:
    """Cache shape of a FwdConfig or BwdDsBf16Config (same field names)."""
    return f"d{cfg.head_dim}_g{cfg.qhead_per_kvhead}_{'tokenblock' if cfg.diagonal_copy else 'token'}"


def quant_shape(cfg) -> str:
    q, kv = cfg.parts[0], cfg.parts[1]
    return f"d{q.head_dim}_q{q.num_heads}_kv{kv.num_heads}_{'tokenblock' if kv.block_tokens > 1 else 'token'}"


def kernel_shape(kernel: str, default) -> str:
    return quant_shape(default) if kernel == "quant" else fwd_shape(default)


class TuningCache:
    def __init__(self, key: TuningKey, path: Path | None = None):
        self.key = key
        self.path = path or cache_path(key)
        self.entries: dict = {}
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("key") != dataclasses.asdict(key):
                warnings.warn(f"flamia_cute: ignoring stale tuning file {self.path} (written for {data.get('key')})",
                              stacklevel=2)
            else:
                self.entries = data.get("entries", {})

    def get(self, kernel: str, wclass: str, shape: str) -> dict | None:
        return self.entries.get(kernel, {}).get(f"{shape}/{wclass}")

    def put(self, kernel: str, wclass: str, shape: str, record: dict) -> None:
        """Write through at once: an interrupted tune keeps everything measured so far."""
        self.entries.setdefault(kernel, {})[f"{shape}/{wclass}"] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": dataclasses.asdict(self.key), "entries": self.entries}, indent=1))
        tmp.replace(self.path)


_loaded: dict = {}


def _tuned_config(kernel: str, default, max_seqlen: int, total_tokens: int, num_docs: int):
    """The tuned config of `kernel` for this workload class, or `default` when nothing (valid) is tuned."""
    if os.environ.get("FLAMIA_CUTE_NO_TUNING") == "1":
        return default
    if "cache" not in _loaded:
        try:
            _loaded["cache"] = TuningCache(TuningKey.current())
        except Exception:
            _loaded["cache"] = None
    cache = _loaded["cache"]
    if cache is None:
        return default
    wclass = workload_class(max_seqlen, total_tokens, num_docs)
    # memoized: a lookup runs on every attention call; rebuilding the config each time costs host time
    resolved = _loaded.setdefault("resolved", {})
    key = (kernel, default, wclass)
    if key not in resolved:
        rec = cache.get(kernel, wclass, kernel_shape(kernel, default))
        try:
            resolved[key] = config_from_fields(kernel, default, rec["config"]) if rec else default
        except (KeyError, TypeError, ValueError) as e:  # written by another version of the fields
            warnings.warn(f"flamia_cute: ignoring tuned {kernel} config {rec.get('config')}: {e}", stacklevel=3)
            resolved[key] = default
    return resolved[key]


DERIVED_MEMO_MAX = 256  # entries: a training run's distinct (shape, packing) signatures between clears


def derived_memo() -> dict:
    """A memo for what callers derive from the tuned records (cute_backend's launch plans): it lives and
    is dropped with the records (tests swap _loaded), and is cleared when it grows past
    DERIVED_MEMO_MAX (packings that change every batch must not grow it without bound)."""
    memo = _loaded.setdefault("derived", {})
    if len(memo) >= DERIVED_MEMO_MAX:
        memo.clear()
    return memo


def tuned_fwd_config(default, max_seqlen: int, total_tokens: int, num_docs: int):
    return _tuned_config("fwd", default, max_seqlen, total_tokens, num_docs)


def tuned_bwd_dsbf16_config(default, max_seqlen: int, total_tokens: int, num_docs: int):
    return _tuned_config("bwd_dsbf16", default, max_seqlen, total_tokens, num_docs)


def tuned_quantize_config(default_multi, max_seqlen: int, total_tokens: int, num_docs: int):
    return _tuned_config("quant", default_multi, max_seqlen, total_tokens, num_docs)
