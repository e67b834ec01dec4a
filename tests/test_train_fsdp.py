"""train/ with --fsdp (FSDP2 fully_shard) and --compile: 2 gloo ranks on the tiny model, emulator attention."""

import csv
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # train/ is a repo-root folder

from train import data, run  # noqa: E402
from train.model import AttentionSpec, Decoder, preset  # noqa: E402

TOKENS = 256
ARGS = ["--preset", "tiny", "--attention", "flamia", "--backend", "emulate", "--steps", "3", "--tokens-per-step",
        str(TOKENS), "--max-doc-tokens", "128", "--eval-every", "0", "--eval-batches", "1", "--leak-samples", "0",
        "--warmup-steps", "1", "--log-every", "1", "--run-name", "fsdp"]


def _worker(rank, world, port, out, extra):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    run.main([*ARGS, "--out", out, "--fsdp", *extra])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(sys.platform != "linux", reason="gloo over TCP on linux")
def test_fsdp_compile_two_ranks_train_on_their_own_batches(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), ["--compile", "--compile-backend", "aot_eager"]), nprocs=2)
    with open(tmp_path / "fsdp.csv") as fh:
        rows = list(csv.DictReader(fh))
    losses = [float(r["train_loss"]) for r in rows]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    # step 1 (before any update) logs the mean over the ranks of each rank's loss on its own batch: rank r takes
    # the stream's batches r, r + 2, ...; the same weights on one process give the same numbers
    torch.manual_seed(0)
    model = Decoder(preset("tiny", data.VOCAB_SIZE), AttentionSpec("flamia", "fp8_tokenblock_dsbf16", "emulate"))
    stream = data.train_batches(TOKENS, 0, data.list_corpus_files(), 128)
    want = []
    with torch.no_grad():
        for b in (next(stream), next(stream)):
            want.append(F.cross_entropy(model(b.tokens, b.cu_seqlens, b.max_seqlen).float(), b.targets,
                                        ignore_index=data.IGNORE_INDEX).item())
    assert abs(losses[0] - sum(want) / 2) < 1e-4, (losses[0], want)
    assert not (tmp_path / "fsdp.csv").read_text().count("nan")
