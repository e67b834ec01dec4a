"""Does a trained model's held-out loss depend on tokens it should not see?

(a) parallel: the loss at sampled positions from one pass over a packed held-out batch
    (what training and the usual eval compute);
(b) causal: for each sampled position, the model is run on its document cut right after
    that position, alone, so no later token and no other document exists.
For a leak-free attention (a) and (b) agree to rounding; a recipe whose quantization
scales see future tokens or other documents (fp8_tensor_current) lets a model that
learned to exploit that look better in (a) than in (b): gap = (a) - (b) < 0.

Standalone: python -m train.eval_leakage --checkpoint RUN.pt [--attention sdpa ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from dataclasses import asdict

import torch
import torch.nn.functional as F

from .data import IGNORE_INDEX, PackedBatch, heldout_batches


def autocast_for(device: torch.device):
    """bf16 autocast on the GPU (like training); fp32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def token_losses(model, batch: PackedBatch) -> torch.Tensor:
    """Per-token cross-entropy (T,), 0 where there is no target."""
    logits = model(batch.tokens, batch.cu_seqlens, batch.max_seqlen)
    return F.cross_entropy(logits.float(), batch.targets, ignore_index=IGNORE_INDEX, reduction="none")


@torch.no_grad()
def parallel_heldout_loss(model, batches: list[PackedBatch], device: torch.device) -> float:
    """Token-weighted mean loss over all held-out targets, one parallel pass per batch."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b in batches:
        b = b.to(device)
        with autocast_for(device):
            losses = token_losses(model, b)
        valid = b.targets != IGNORE_INDEX
        total += float(losses[valid].sum())
        count += int(valid.sum())
    model.train(was_training)
    return total / max(count, 1)


def sample_positions(batch: PackedBatch, n: int, seed: int, max_prefix: int) -> list[tuple[int, int]]:
    """(document start, position) pairs with a target, at most max_prefix tokens into their document."""
    starts = torch.repeat_interleave(batch.cu_seqlens[:-1].long(), torch.tensor(batch.doc_lengths))
    pos = torch.arange(batch.tokens.shape[0])
    ok = (batch.targets.cpu() != IGNORE_INDEX) & (pos - starts < max_prefix)
    candidates = pos[ok]
    g = torch.Generator().manual_seed(seed)
    chosen = candidates[torch.randperm(len(candidates), generator=g)[:n]].sort().values
    return [(int(starts[p]), int(p)) for p in chosen]


@torch.no_grad()
def causal_gap(model, batches: list[PackedBatch], device: torch.device, samples: int = 256, seed: int = 0,
               max_prefix: int = 2048) -> dict:
    """Compare (a) parallel and (b) honestly causal losses at the same sampled held-out positions."""
    was_training = model.training
    model.eval()
    per_batch = max(1, math.ceil(samples / max(len(batches), 1)))
    parallel, causal = [], []
    for i, b in enumerate(batches):
        if len(parallel) >= samples:
            break
        picks = sample_positions(b, min(per_batch, samples - len(parallel)), seed + i, max_prefix)
        bd = b.to(device)
        with autocast_for(device):
            full = token_losses(model, bd)
        for start, p in picks:
            prefix = bd.tokens[start : p + 1]  # the document up to and including p: nothing later exists
            cu = torch.tensor([0, len(prefix)], dtype=torch.int32, device=device)
            with autocast_for(device):
                logits = model(prefix, cu, len(prefix))
            causal.append(float(F.cross_entropy(logits[-1:].float(), bd.targets[p : p + 1])))
            parallel.append(float(full[p]))
    model.train(was_training)
    a, c = torch.tensor(parallel, dtype=torch.float64), torch.tensor(causal, dtype=torch.float64)
    diff = a - c
    n = len(diff)
    return {
        "samples": n,
        "loss_parallel": float(a.mean()) if n else float("nan"),
        "loss_causal": float(c.mean()) if n else float("nan"),
        "gap": float(diff.mean()) if n else float("nan"),  # (a) - (b): negative means the parallel pass peeks
        "gap_stderr": float(diff.std() / math.sqrt(n)) if n > 1 else float("nan"),
        "mean_abs_diff": float(diff.abs().mean()) if n else float("nan"),  # per-position disagreement, any sign
    }


def main(argv=None):
    from .model import AttentionSpec, Decoder, ModelConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a .pt written by train.run --save-model")
    ap.add_argument("--attention", choices=("flamia", "fa4", "sdpa"), help="evaluate under another attention (same weights)")
    ap.add_argument("--recipe", help="flamia recipe to evaluate under (default: the training one)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--max-prefix", type=int, default=2048)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    trained = AttentionSpec(**ckpt["attention"])
    spec = AttentionSpec(
        kind=args.attention or trained.kind,
        recipe=args.recipe or trained.recipe,
        backend=args.backend,
    )
    spec.check_device(device)
    model = Decoder(ModelConfig(**ckpt["config"]), spec)
    model.load_state_dict(ckpt["model"])
    model.to(device)
    batches = heldout_batches(args.eval_batches, ckpt["tokens_per_step"], max_doc_tokens=ckpt["max_doc_tokens"],
                              doc_tokens=ckpt.get("doc_tokens"))
    result = {"checkpoint": args.checkpoint, "trained_with": ckpt["attention"], "evaluated_with": asdict(spec)}
    result["heldout_loss"] = parallel_heldout_loss(model, batches, device)
    result.update(causal_gap(model, batches, device, args.samples, args.seed, args.max_prefix))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
