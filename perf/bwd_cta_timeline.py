"""Where the bf16-dS backward's time goes per CTA: each CTA's start and end on its SM.

    OUT=dir python perf/bwd_cta_timeline.py     # BREAKDOWN_WORKLOADS=16x1k,4x4k to restrict

The kernel alone (dO's quantization, D and the dV fold references precomputed), built with
BwdDsBf16Config.cta_timeline (%globaltimer_lo at the CTA's start and after the first consumer
warpgroup's epilogue, %smid, the CTA's query tiles), once per head window (the plain blocks order
and auto_head_window's). Per workload it prints and writes to $OUT/bwd_cta_timeline.json:
- span: first start to last end; busy: the CTAs' summed durations over span x SMs;
- the fit duration = per_tile * tiles + per_cta over the CTAs (least squares, µs): per_cta is what
  a CTA costs besides its tiles (prologue, two K/V phases, diagonal tiles, epilogue);
- gap: the mean time an SM waits between the end of one CTA and the start of its next;
- tail: span minus the time at which the first SM ran out of CTAs (the last wave's imbalance);
- by_tiles: CTAs and their mean duration per query-tile count;
- segments: the mean µs of each step of the first consumer warpgroup's CTA (TIMELINE_FIELDS' stamps,
  session 19): launch to consumer start, phase 0's scales, its K/V wait, its K conversion and V
  transpose, the diagonal tiles, the phase change (CTAs with off-diagonal tiles), the off-diagonal
  tiles, the epilogue; with the CTAs of each tile count apart (segments_by_tiles, the first 8).
"""

import json
import os

import torch
from bench_fwd_breakdown import backward_inputs  # noqa: E402  (perf/ is the script's directory)

from flamia_cute.attention_bwd_dsbf16_sm90 import (
    KEY_BLOCK,
    TIMELINE_FIELDS,
    TIMELINE_WORDS,
    BwdDsBf16Config,
    auto_head_window,
    cta_timeline_words,
    flamia_bwd_dsbf16_sm90_from_saved,
)
from flamia_cute.bench import DEFAULT_WORKLOADS, Case
from flamia_cute.codes_sm90 import e4m3_codes_to_bf16
from flamia_cute.cute_backend import quantize_operands

SEGMENTS = (("launch to consumers", "start", "consumer_start"), ("phase 0 scales", "consumer_start", "scales0"),
            ("phase 0 K/V wait", "scales0", "kv0"), ("phase 0 K, V in shared memory", "kv0", "ready0"),
            ("diagonal tiles", "ready0", "diagonal_done"), ("phase change", "diagonal_done", "ready1"),
            ("off-diagonal tiles", "ready1", "tiles_done"), ("epilogue", "tiles_done", "end"))


def segments(rec: torch.Tensor) -> dict:
    """Mean µs of each SEGMENTS step over the CTAs of rec (wrapped stamps unwrapped against start);
    the phase change and off-diagonal tiles over the CTAs that have them (ready1 != 0)."""
    f = {name: i for i, name in enumerate(TIMELINE_FIELDS)}
    t = {name: (rec[:, f[name]] - rec[:, 0]) & 0xFFFFFFFF for name in f if name not in ("sm", "tiles", "spare")}
    has1 = rec[:, f["ready1"]] != 0
    out = {}
    for label, a, b in SEGMENTS:
        if a == "diagonal_done" and b == "ready1":
            sel = has1
        elif a == "ready1":
            sel, a = torch.ones_like(has1), None
        else:
            sel = torch.ones_like(has1)
        if a is None:  # off-diagonal tiles: from phase 1 ready, or nothing without phase 1
            d = torch.where(has1, t["tiles_done"] - t["ready1"], torch.zeros_like(t["ready1"]))
        else:
            d = t[b] - t[a]
        out[label] = round(float(d[sel].double().mean()) / 1e3, 3) if bool(sel.any()) else None
    return out


def summarize(rec: torch.Tensor) -> dict:
    """rec (CTAs, TIMELINE_WORDS) int64: the records of the CTAs that ran (end > 0)."""
    rec = rec[rec[:, 1] != 0]
    start, end, sm, tiles = (rec[:, i] for i in range(4))
    t0 = int(start.min())
    start, end = (start - t0) & 0xFFFFFFFF, (end - t0) & 0xFFFFFFFF  # the 32-bit timer may wrap once
    dur = (end - start).double() / 1e3  # µs
    span = float(end.max() - start.min()) / 1e3
    x = torch.stack([tiles.double(), torch.ones_like(dur)], 1)
    per_tile, per_cta = torch.linalg.lstsq(x, dur[:, None]).solution[:, 0].tolist()
    sms = int(sm.max()) + 1
    gaps, last_ends = [], []
    for s in range(sms):
        idx = (sm == s).nonzero()[:, 0]
        if idx.numel() == 0:
            continue
        order = idx[start[idx].argsort()]
        st, en = start[order], end[order]
        gaps += ((st[1:] - en[:-1]).double() / 1e3).tolist()
        last_ends.append(float(en.max()) / 1e3)
    by_tiles = {}  # query tiles -> (CTAs, mean µs): what a CTA of n tiles costs, n = 1, 2 (diagonal only), ...
    for n in tiles.unique().tolist()[:64]:
        sel = tiles == n
        by_tiles[int(n)] = (int(sel.sum()), round(float(dur[sel].mean()), 3))
    segs_by_tiles = {int(n): segments(rec[tiles == n]) for n in tiles.unique().tolist()[:8]}
    return {"ctas": int(rec.shape[0]), "sms": sms, "span_us": span, "by_tiles": by_tiles,
            "segments": segments(rec), "segments_by_tiles": segs_by_tiles,
            "busy": float(dur.sum()) / (span * sms), "per_tile_us": per_tile, "per_cta_us": per_cta,
            "gap_us": sum(gaps) / max(1, len(gaps)), "tail_us": span - min(last_ends),
            "tiles_mean": float(tiles.double().mean())}


def run(name, lengths):
    case = Case(name, lengths, 16, 16, 128, "cuda").build()
    q, k, v, _ = case.sets[0]
    qq, (kq, kt), (vq, vt) = quantize_operands(q, k, v, case.cu, 128, case.max_len)
    dout, out, lse, delta, doq, dv_ref = backward_inputs(case, qq, kq, kt, vq, vt)
    q_bf16 = e4m3_codes_to_bf16(qq.data_td, qq.scale)
    hk, docs = kq.data_td.shape[1], case.cu.numel() - 1
    n_blocks = (case.max_len + KEY_BLOCK - 1) // KEY_BLOCK
    buf = torch.zeros(cta_timeline_words(hk, docs, n_blocks), dtype=torch.int32, device="cuda")
    row = {"workload": name}
    for w in sorted({1, auto_head_window(hk, case.max_len)}):
        cfg = BwdDsBf16Config(128, diagonal_copy=True, head_window=w, cta_timeline=True)
        for _ in range(3):  # warm: the last run's record is kept
            flamia_bwd_dsbf16_sm90_from_saved(dout, out, lse, qq, kq, vq, kt, vt, case.cu, case.max_len, case.scale,
                                              config=cfg, do_quantized=doq, delta=delta, dv_ref=dv_ref,
                                              q_bf16=q_bf16, timeline=buf)
        torch.cuda.synchronize()
        rec = buf.view(-1, TIMELINE_WORDS).to(torch.int64).cpu() & 0xFFFFFFFF
        row[f"window {w}"] = summarize(rec)
    print(json.dumps(row), flush=True)
    return row


def main():
    wl = json.loads(DEFAULT_WORKLOADS.read_text())["workloads"]
    names = [w for w in os.environ.get("BREAKDOWN_WORKLOADS", "").split(",") if w] or \
        ["16x1k", "4x4k", "longtail32k", "mixed16k", "1x16k"]
    rows = [run(n, wl[n]) for n in names]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bwd_cta_timeline.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
