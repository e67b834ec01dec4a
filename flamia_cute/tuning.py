"""Per-GPU autotuning: search space, pruning, the tuning cache and run-time lookup.

The cache is one JSON file per GPU under <cache dir>/tuning/, keyed by GPU
name, SM count, CUDA driver, DSL and package versions. A file written under
other versions is stale: ignored with a one-line warning, never used.
Kernels look up their config by workload class (from max_seqlen and the mean
document length, both known on the host without a sync).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

SMEM_LIMIT_SM90 = 227 * 1024


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

        from . import __version__
        from .compile_cache import dsl_version

        props = torch.cuda.get_device_properties(0)
        driver = ".".join(str(x) for x in torch.cuda.driver_version()) if hasattr(torch.cuda, "driver_version") \
            else str(torch.version.cuda)
        return cls(props.name, props.multi_processor_count, driver, dsl_version(), __version__)

    def filename(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.gpu}_{self.sm_count}sm") + ".json"


def cache_path(key: TuningKey) -> Path:
    from .compile_cache import cache_dir

    return cache_dir() / "tuning" / key.filename()


# ----------------------------------------------------------------------------- search space


def fwd_smem_bytes(cfg) -> int:
    tile = cfg.tile_m * cfg.head_dim
    return tile + 2 * cfg.kv_stages * cfg.tile_n * cfg.head_dim + 2 * cfg.tile_n * 4 * cfg.kv_stages + 1024


def fwd_space(head_dim: int, group: int, diagonal_copy: bool):
    """Every forward config the kernel exposes, with the reason each pruned one was dropped."""
    from .attention_fwd_sm90 import FwdConfig

    keep, pruned = [], []
    base = FwdConfig(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=diagonal_copy)
    keep.append((base, "default"))
    for stages in (2, 3, 4):
        for pingpong in (True, False):
            for overlap in (True, False):
                cfg = FwdConfig(head_dim=head_dim, qhead_per_kvhead=group, diagonal_copy=diagonal_copy,
                                kv_stages=stages, pingpong=pingpong, intra_wg_overlap=overlap)
                if cfg == base:
                    continue
                smem = fwd_smem_bytes(cfg)
                if overlap and not diagonal_copy:
                    pruned.append((cfg, "spills: the per-token recipe's overlapped schedule needs > 240 registers"))
                else:
                    (keep if smem <= SMEM_LIMIT_SM90 else pruned).append((cfg, f"smem {smem} B"))
    return keep, pruned


def quantize_space(head_dim: int, num_heads: int, block_tokens: int, token_copy: bool):
    from .quantize_sm90 import QuantizeConfig

    keep, pruned = [], []
    for hg in (1, 2, 4, 8):
        try:
            cfg = QuantizeConfig(head_dim=head_dim, num_heads=num_heads, block_tokens=block_tokens,
                                 emit_token_copy=token_copy, heads_per_cta=hg)
        except ValueError as e:
            pruned.append((hg, str(e)))
            continue
        smem = cfg.smem_bytes if hasattr(cfg, "smem_bytes") else 0
        (keep if smem <= SMEM_LIMIT_SM90 else pruned).append((cfg, f"smem {smem} B"))
    return keep, pruned


# ----------------------------------------------------------------------------- cache


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


def tuned_fwd_config(default, max_seqlen: int, total_tokens: int, num_docs: int):
    """The tuned FwdConfig for this workload class, or `default` when nothing (valid) is tuned."""
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
    rec = cache.get("fwd", workload_class(max_seqlen, total_tokens, num_docs), fwd_shape(default))
    if rec is None:
        return default
    return dataclasses.replace(default, **rec["config"])


def fwd_shape(cfg) -> str:
    return f"d{cfg.head_dim}_g{cfg.qhead_per_kvhead}_{'tokenblock' if cfg.diagonal_copy else 'token'}"


# ----------------------------------------------------------------------------- the tune command


def run_tune(args) -> int:
    import sys

    import torch

    from .bench import DEFAULT_WORKLOADS, _progress, _time_calls
    from .cute_backend import KERNEL_RECIPES

    data = json.loads(Path(args.workloads or DEFAULT_WORKLOADS).read_text())
    head = data["head_configs"].get(args.heads)
    if head is None:
        print(f"tune --heads: unknown {args.heads!r}; known {sorted(data['head_configs'])}", file=sys.stderr)
        return 2
    if args.recipe not in KERNEL_RECIPES:
        print(f"tune --recipe: kernels exist for {sorted(KERNEL_RECIPES)}, not {args.recipe!r}", file=sys.stderr)
        return 2
    wl = data["workloads"]
    if args.only:
        wl = {w: wl[w] for w in args.only.split(",") if w in wl} or wl
    block = KERNEL_RECIPES[args.recipe]
    group = head["heads_q"] // head["heads_kv"]
    keep, pruned = fwd_space(head["head_dim"], group, block > 1)
    classes = {w: workload_class(max(ls), sum(ls), len(ls)) for w, ls in wl.items()}
    if args.dry_run:
        print(f"fwd search space ({len(keep)} kept, {len(pruned)} pruned):")
        for cfg, why in keep:
            print(f"  keep   stages={cfg.kv_stages} pingpong={cfg.pingpong} overlap={cfg.intra_wg_overlap}  ({why})")
        for cfg, why in pruned:
            print(f"  pruned {cfg}: {why}")
        for w, c in classes.items():
            print(f"  workload {w}: class {c}")
        return 0
    if not torch.cuda.is_available():
        print("tune: needs a GPU (use --dry-run to see the space)", file=sys.stderr)
        return 2
    cache = TuningCache(TuningKey.current())
    shape = fwd_shape(keep[0][0])
    if args.print:
        for k, recs in cache.entries.items():
            for sk, rec in recs.items():
                print(f"{k} {sk}: {rec['config']}  tuned {rec['ms']:.3f} ms vs default {rec['default_ms']:.3f} ms")
        return 0
    from .attention_fwd_sm90 import flamia_fwd_sm90
    from .bench import Case
    from .cute_backend import quantize_operands

    rows = []
    for w, lengths in _progress(list(wl.items())):
        wclass = classes[w]
        if cache.get("fwd", wclass, shape) and not args.force:
            rows.append((w, wclass, "cached", cache.get("fwd", wclass, shape)))
            continue
        case = Case(w, lengths, head["heads_q"], head["heads_kv"], head["head_dim"], "cuda").build()
        ops = [quantize_operands(q, k, v, case.cu, block) for q, k, v, _ in case.sets]
        times = {}
        for cfg, _ in keep:
            def call(i, cfg=cfg, ops=ops, case=case):
                qq, (kq, kt), (vq, vt) = ops[i]
                flamia_fwd_sm90(qq.data_td, qq.scale, kq.data_td, kq.scale, vq.data_dt, vq.scale,
                                kt.data_td if kt else None, kt.scale if kt else None,
                                vt.data_dt if vt else None, vt.scale if vt else None,
                                case.cu, case.max_len, case.scale, cfg)
            times[cfg] = _time_calls(call, len(ops), "cuda", reps=args.reps)
        best = min(times, key=times.get)
        default = keep[0][0]
        rec = {"config": {"kv_stages": best.kv_stages, "pingpong": best.pingpong,
                          "intra_wg_overlap": best.intra_wg_overlap},
               "ms": times[best], "default_ms": times[default], "workload": w,
               "all": {f"stages={c.kv_stages},pingpong={c.pingpong},overlap={c.intra_wg_overlap}": round(t, 4)
                       for c, t in times.items()}}
        cache.put("fwd", wclass, shape, rec)
        rows.append((w, wclass, "tuned", rec))
    print(f"\n{'workload':14s} {'class':14s} {'status':7s} {'default ms':>10s} {'tuned ms':>9s}  config")
    for w, c, st, rec in rows:
        print(f"{w:14s} {c:14s} {st:7s} {rec['default_ms']:10.3f} {rec['ms']:9.3f}  {rec['config']}")
    print(f"\ntuning file: {cache.path}")
    return 0
