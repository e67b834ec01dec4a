"""Train the small Llama-style model on packed source files with a chosen attention; compare runs.

    python -m train.run --attention flamia --recipe fp8_tokenblock_dsbf16 --steps 1000 --out runs/
    python -m train.run --compare runs/
    torchrun --nproc-per-node 8 -m train.run --fsdp --compile ...   # FSDP2 data parallel, compiled

With --fsdp each rank trains on its own batches (every WORLD_SIZE-th of the stream) with the blocks and the
model sharded by FSDP2's fully_shard; the logged loss is the mean over the ranks and rank 0 writes the files.

Each run writes DIR/<run>.csv (one row per step), DIR/<run>.summary.json and redraws
DIR/loss_curves.png from every CSV in DIR (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import csv
import glob
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, VOCAB_SIZE, heldout_batches, list_corpus_files, train_batches
from .eval_leakage import autocast_for, causal_gap, parallel_heldout_loss
from .model import ATTENTION_KINDS, AttentionSpec, AttentionTimer, Decoder, preset

CSV_FIELDS = ("step", "lr", "train_loss", "grad_norm", "tokens_per_s", "step_ms", "attn_ms", "peak_mem_mb", "step_mem_mb",
              "heldout_loss")
FINAL_WINDOW = 20  # final train loss = mean over the last steps: one step's loss is noisy


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", choices=ATTENTION_KINDS, default="flamia")
    ap.add_argument("--recipe", default="fp8_tokenblock_dsbf16", help="flamia recipe name (ignored by fa4/sdpa)")
    ap.add_argument("--backend", default="auto", help="flamia backend: auto | emulate | cute")
    ap.add_argument("--preset", choices=("tiny", "llama_125m"), default="llama_125m")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--max-doc-tokens", type=int, default=None,
                    help="longer documents are cut into pieces that each start a new document (context length; "
                         "default 4096, or --doc-tokens)")
    ap.add_argument("--doc-tokens", type=int, default=None,
                    help="concatenate consecutive corpus files into documents of exactly this many tokens (long context)")
    ap.add_argument("--timing-warmup", type=int, default=5,
                    help="steps left out of the summary's median tokens/s and step time (compiles, allocator warm-up)")
    ap.add_argument("--seed", type=int, default=0, help="model init and data order")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=None, help="default: min(100, steps // 10)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100, help="held-out loss every N steps (0: at the end only)")
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--leak-samples", type=int, default=128, help="positions for the causal held-out check (0: skip)")
    ap.add_argument("--leak-max-prefix", type=int, default=2048)
    ap.add_argument("--repeat-batch", action="store_true", help="train on the first batch every step (smoke test)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fsdp", action="store_true",
                    help="FSDP2 (fully_shard per block) over the ranks torchrun starts: nccl on GPUs, gloo on the CPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile every block (flamia's ops trace as custom ops)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: no codegen)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--save-model", action="store_true", help="write DIR/<run>.pt for train.eval_leakage")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--out", default="runs")
    ap.add_argument("--compare", metavar="DIR", help="plot every CSV in DIR and print the comparison table; no training")
    ap.add_argument("--control", default=None, help="run name of the control for --compare (default: fa4, else sdpa, else bf16)")
    return ap.parse_args(argv)


def default_run_name(args) -> str:
    what = {"flamia": f"flamia-{args.recipe}", "fa4": "fa4-bf16", "sdpa": "sdpa"}[args.attention]
    return f"{what}-s{args.seed}"


def lr_at(step: int, steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to peak, then cosine decay to min_ratio * peak at the last step (step counts from 1)."""
    if step <= warmup:
        return peak * step / max(warmup, 1)
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model, lr, weight_decay, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices and embeddings; not norm gains
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def setup_distributed(args, device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of an --fsdp run under torchrun (env:// rendezvous); (0, 1, device) otherwise."""
    if not args.fsdp:
        return 0, 1, device
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def shard_model(model, args):
    """FSDP2: each block, then the root (embeddings, final norm, head); --compile compiles each block."""
    if args.compile:
        for block in model.blocks:
            block.compile(backend=args.compile_backend)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def _local(t):
    """A DTensor's full value (FSDP's grad norm), else t."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def doc_limits(args) -> tuple[int, int | None]:
    """(max_doc_tokens, doc_tokens) of a run: --max-doc-tokens defaults to 4096, or to --doc-tokens, which it
    must not cut."""
    if args.doc_tokens is not None and args.doc_tokens < 2:
        raise SystemExit(f"--doc-tokens must be >= 2, got {args.doc_tokens}")
    max_doc = args.max_doc_tokens if args.max_doc_tokens is not None else (args.doc_tokens or 4096)
    if args.doc_tokens and max_doc < args.doc_tokens:
        raise SystemExit(f"--max-doc-tokens {max_doc} would cut the --doc-tokens {args.doc_tokens} documents")
    return max_doc, args.doc_tokens


def throughput(rows: list[dict], warmup: int) -> dict:
    """Median tokens/s, step and attention time over the steps after `warmup`, and the largest step peak
    memory (all steps; None off the GPU), from the CSV rows' strings."""
    timed = rows[warmup:] or rows
    med = lambda key: statistics.median(vals) if (vals := [float(r[key]) for r in timed if r.get(key)]) else None
    most = lambda key: max((float(r[key]) for r in rows if r.get(key)), default=None)
    return {"timed_steps": len(timed), "tokens_per_s": med("tokens_per_s"), "step_ms": med("step_ms"),
            "attn_ms": med("attn_ms"), "peak_mem_mb": most("peak_mem_mb"), "step_mem_mb": most("step_mem_mb")}


def train(args) -> dict:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    doc_limits(args)  # bad --doc-tokens / --max-doc-tokens stop here, before any process group
    if device.type == "cuda":
        os.environ.setdefault("FLAMIA_CUTE_TRUST_CU_SEQLENS", "1")  # data.py builds them; skip a sync per call
    rank, world, device = setup_distributed(args, device)
    try:
        return _train(args, device, rank, world)
    finally:
        if args.fsdp:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(args, device, rank: int, world: int) -> dict:
    max_doc_tokens, doc_tokens = doc_limits(args)
    spec = AttentionSpec(args.attention, args.recipe if args.attention == "flamia" else "none", args.backend)
    spec.check_device(device)
    run = args.run_name or default_run_name(args)
    writes = rank == 0  # the files and the log: rank 0
    os.makedirs(args.out, exist_ok=True)
    warmup = args.warmup_steps if args.warmup_steps is not None else min(100, args.steps // 10)

    torch.manual_seed(args.seed)  # same seed -> same initial weights whatever the attention
    cfg = preset(args.preset, VOCAB_SIZE)
    model = Decoder(cfg, spec).to(device)
    n_params = model.num_parameters()
    model = shard_model(model, args)
    opt = make_optimizer(model, args.lr, args.weight_decay, device)
    files = list_corpus_files()
    # data parallel: rank r trains on batches r, r + world, ...
    batches = itertools.islice(train_batches(args.tokens_per_step, args.seed, files, max_doc_tokens, doc_tokens),
                               rank, None, world)
    fixed_batch = next(batches).to(device) if args.repeat_batch else None
    heldout = heldout_batches(args.eval_batches, args.tokens_per_step, files, max_doc_tokens, doc_tokens)
    # compiled blocks trace the timer's CUDA events out of the graph (never recorded): no attention time
    timer = None if args.compile else AttentionTimer(device)
    log = print if writes else (lambda *a, **k: None)
    log(f"[{run}] {n_params / 1e6:.1f}M params, {args.preset}, {spec}, device {device}, "
        f"{len(files)} corpus files, {args.steps} steps x {args.tokens_per_step} tokens"
        + (f" x {world} ranks (FSDP2)" if args.fsdp else "") + (f", compiled ({args.compile_backend})" if args.compile else "")
        + ", documents " + (f"of {doc_tokens} tokens (files concatenated)" if doc_tokens
                            else f"of at most {max_doc_tokens} tokens"))

    csv_path = os.path.join(args.out, f"{run}.csv")
    losses, heldout_loss, diverged_at, rows = [], float("nan"), None, []
    with open(csv_path if writes else os.devnull, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for step in range(1, args.steps + 1):
            lr = lr_at(step, args.steps, args.lr, warmup, args.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = fixed_batch if fixed_batch is not None else next(batches).to(device)
            if device.type == "cuda":  # the step's peak over what it starts with (weights, optimizer state, batch)
                torch.cuda.synchronize()
                start_mem = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with autocast_for(device):
                logits = model(batch.tokens, batch.cu_seqlens, batch.max_seqlen, timer=timer)
            loss = F.cross_entropy(logits.float(), batch.targets, ignore_index=IGNORE_INDEX)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_v, grad_norm_v = _mean_over_ranks(loss.detach(), world), _local(grad_norm).item()  # host sync
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - t0
            row = {
                "step": step, "lr": f"{lr:.3e}", "train_loss": f"{loss_v:.5f}", "grad_norm": f"{grad_norm_v:.4f}",
                "tokens_per_s": f"{batch.tokens.numel() / step_s:.0f}", "step_ms": f"{1000 * step_s:.1f}",
                "attn_ms": f"{timer.pop_ms():.1f}" if timer else "", "peak_mem_mb": "", "step_mem_mb": "",
                "heldout_loss": "",
            }
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated()
                row["peak_mem_mb"], row["step_mem_mb"] = f"{peak / 2**20:.0f}", f"{(peak - start_mem) / 2**20:.0f}"
            losses.append(loss_v)
            if not math.isfinite(loss_v):
                diverged_at = step
            elif step == args.steps or (args.eval_every and step % args.eval_every == 0):
                heldout_loss = parallel_heldout_loss(model, heldout, device)
                row["heldout_loss"] = f"{heldout_loss:.5f}"
            writer.writerow(row)
            rows.append(row)
            fh.flush()  # a crashed or killed run still leaves its curve
            if step % args.log_every == 0 or step in (1, args.steps) or diverged_at:
                log(f"[{run}] step {step:5d} loss {loss_v:.4f} gnorm {grad_norm_v:.3f} lr {lr:.2e} "
                      f"{row['tokens_per_s']} tok/s attn {row['attn_ms'] or '-'} ms / step {row['step_ms']} ms"
                      + (f" heldout {row['heldout_loss']}" if row["heldout_loss"] else ""))
            if diverged_at:
                log(f"[{run}] loss is not finite at step {step}: stopping")
                break

    leak = {}
    if args.leak_samples and diverged_at is None:
        leak = causal_gap(model, heldout, device, args.leak_samples, args.seed, args.leak_max_prefix)
        log(f"[{run}] causal held-out check: parallel {leak['loss_parallel']:.4f} causal {leak['loss_causal']:.4f} "
              f"gap {leak['gap']:+.5f} +- {leak['gap_stderr']:.5f} (n={leak['samples']})")
    tail = losses[-FINAL_WINDOW:]
    summary = {
        "run": run, "attention": asdict(spec), "preset": args.preset, "params": n_params, "steps": len(losses),
        "tokens_per_step": args.tokens_per_step, "max_doc_tokens": max_doc_tokens, "doc_tokens": doc_tokens,
        "seed": args.seed, "throughput": throughput(rows, args.timing_warmup),
        "lr": args.lr, "repeat_batch": args.repeat_batch,
        "final_train_loss": sum(tail) / len(tail), "heldout_loss": heldout_loss, "diverged_at": diverged_at,
        "leakage": leak, "device": str(device), "world_size": world, "fsdp": args.fsdp, "compile": args.compile,
    }
    state = full_state_dict(model, args) if args.save_model else None
    if not writes:
        return summary
    with open(os.path.join(args.out, f"{run}.summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    if args.save_model:
        torch.save({"model": state, "config": asdict(cfg), "attention": asdict(spec),
                    "tokens_per_step": args.tokens_per_step, "max_doc_tokens": max_doc_tokens, "doc_tokens": doc_tokens},
                   os.path.join(args.out, f"{run}.pt"))
    plot_runs(args.out)
    return summary


def _mean_over_ranks(x: torch.Tensor, world: int) -> float:
    if world > 1:
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x)
        x /= world
    return x.item()


def full_state_dict(model, args) -> dict:
    """The unsharded state dict (every rank takes part under FSDP); compiled blocks keep their plain names."""
    if args.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = model.state_dict()
    return {k.replace("._orig_mod", ""): v for k, v in state.items()}


def load_runs(directory: str) -> dict[str, dict]:
    """run name -> {'rows': CSV rows, 'summary': summary dict or {}}."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.csv"))):
        name = os.path.basename(path)[: -len(".csv")]
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
        summary_path = os.path.join(directory, f"{name}.summary.json")
        summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
        runs[name] = {"rows": rows, "summary": summary}
    return runs


def plot_runs(directory: str) -> str | None:
    """Train (smoothed) and held-out loss of every run in DIR on one plot; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss_curves.png (pip install matplotlib); the CSVs have the curves")
        return None
    runs = load_runs(directory)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, (name, run) in enumerate(runs.items()):
        color = f"C{i % 10}"
        steps = [int(r["step"]) for r in run["rows"]]
        loss = [float(r["train_loss"]) for r in run["rows"]]
        smooth, ema = [], None
        for v in loss:
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            smooth.append(ema)
        ax.plot(steps, loss, color=color, alpha=0.2, linewidth=0.7)
        ax.plot(steps, smooth, color=color, label=f"{name} train (EMA)")
        ev = [(int(r["step"]), float(r["heldout_loss"])) for r in run["rows"] if r.get("heldout_loss")]
        if ev:
            ax.plot([s for s, _ in ev], [v for _, v in ev], "o--", color=color, markersize=3, label=f"{name} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(f"loss curves: {directory}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = os.path.join(directory, "loss_curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pick_control(runs: dict[str, dict], control: str | None) -> str | None:
    if control:
        if control not in runs:
            raise ValueError(f"--control {control!r} is not a run in the directory; runs: {sorted(runs)}")
        return control
    kinds = {name: run["summary"].get("attention", {}) for name, run in runs.items()}
    for wanted in ("fa4", "sdpa"):
        for name, spec in kinds.items():
            if spec.get("kind") == wanted:
                return name
    for name, spec in kinds.items():
        if spec.get("recipe") == "bf16":
            return name
    return None


def _num(x, width: int = 9) -> str:
    return f"{x:{width}.0f}" if x is not None else f"{'-':>{width}s}"


def compare(directory: str, control: str | None = None) -> str:
    runs = load_runs(directory)
    if not runs:
        raise SystemExit(f"--compare: no CSV in {directory}")
    plot_runs(directory)
    ctrl = pick_control(runs, control)
    ctrl_heldout = runs[ctrl]["summary"].get("heldout_loss", float("nan")) if ctrl else float("nan")
    header = (f"{'run':34s} {'steps':>6s} {'train':>8s} {'held-out':>9s} {'d vs ctrl':>10s} "
              f"{'causal':>8s} {'leak gap (a)-(b)':>21s} {'attn ms':>8s} {'tokens/s':>9s} {'peak MiB':>9s} "
              f"{'step MiB':>9s}")
    lines = [f"control: {ctrl or '(none found)'}; train = mean of the last {FINAL_WINDOW} steps; "
             "leak gap < 0 beyond its stderr means the parallel pass sees what it should not; tokens/s: median "
             "over the steps after the timing warm-up; peak MiB: the largest peak of a step (torch.cuda."
             "max_memory_allocated), step MiB: that peak over what the step started with", header]
    for name, run in runs.items():
        s = run["summary"]
        rows = run["rows"]
        final = s.get("final_train_loss")
        if final is None and rows:
            tail = [float(r["train_loss"]) for r in rows[-FINAL_WINDOW:]]
            final = sum(tail) / len(tail)
        held = s.get("heldout_loss", float("nan"))
        leak = s.get("leakage") or {}
        attn = [float(r["attn_ms"]) for r in rows[1:] if r["attn_ms"]] or [float("nan")]  # step 1: compilation
        gap = f"{leak['gap']:+.5f}+-{leak['gap_stderr']:.5f}" if leak else "-"
        tp = s.get("throughput") or throughput(rows, 1)
        lines.append(
            f"{name:34s} {len(rows):6d} {final if final is not None else float('nan'):8.4f} {held:9.4f} "
            f"{held - ctrl_heldout:+10.4f} {leak.get('loss_causal', float('nan')):8.4f} {gap:>21s} "
            f"{sum(attn) / len(attn):8.1f} {_num(tp['tokens_per_s'])} {_num(tp['peak_mem_mb'])} {_num(tp['step_mem_mb'])}"
        )
    table = "\n".join(lines)
    print(table)
    return table


def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        return compare(args.compare, args.control)
    return train(args)


if __name__ == "__main__":
    main()
