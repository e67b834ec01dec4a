"""Real text available offline everywhere: the Python source files of torch and of the standard library.

Each file is one document: BOS + its bytes + EOS (byte-level tokenizer, no downloads).
Files are split into train and held-out sets by a hash of their corpus-relative name,
so the split is stable across machines and runs. Documents are packed into fixed-size
token batches with int32 cu_seqlens; a document longer than max_doc_tokens, or that does
not fit in what is left of a batch, is cut, and each piece is a separate document (no
attention across pieces, positions restart). The cap bounds attention context, and the
emulator's memory (it builds a full score matrix per document). With doc_tokens, consecutive files
are first concatenated into long documents of exactly doc_tokens tokens (concat_documents: the
long-context benchmark's 16k-token documents; the files' BOS and EOS tokens stay inside).

The file list depends on the installed torch and Python versions: runs that are
compared must use the same machine (or the same versions).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

BOS, EOS = 256, 257
VOCAB_SIZE = 258
IGNORE_INDEX = -100  # cross_entropy's ignore_index: no target at a document's last token
HELDOUT_FRACTION = 0.02
HELDOUT_SEED = 1234  # the held-out order is fixed, whatever the training seed: every run sees the same eval data
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}  # keep third-party code out of the stdlib root


@dataclass(frozen=True)
class SourceFile:
    name: str  # corpus-relative, e.g. "torch/nn/functional.py" or "stdlib/json/decoder.py"
    path: str


def corpus_roots() -> list[tuple[str, str]]:
    return [("torch", os.path.dirname(torch.__file__)), ("stdlib", sysconfig.get_paths()["stdlib"])]


def list_corpus_files(roots: Iterable[tuple[str, str]] | None = None) -> list[SourceFile]:
    """Every .py file under the roots, sorted by name (a deterministic list)."""
    files = []
    for prefix, root in roots if roots is not None else corpus_roots():
        for directory, subdirs, names in os.walk(root):
            subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
            for n in names:
                if n.endswith(".py"):
                    path = os.path.join(directory, n)
                    rel = os.path.relpath(path, root).replace(os.sep, "/")
                    files.append(SourceFile(f"{prefix}/{rel}", path))
    return sorted(files, key=lambda f: f.name)


def is_heldout(name: str, fraction: float = HELDOUT_FRACTION) -> bool:
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def split_corpus(files: list[SourceFile], fraction: float = HELDOUT_FRACTION):
    """(train, heldout): disjoint by file."""
    train = [f for f in files if not is_heldout(f.name, fraction)]
    heldout = [f for f in files if is_heldout(f.name, fraction)]
    return train, heldout


def encode(data: bytes) -> torch.Tensor:
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() if data else torch.empty(0, dtype=torch.long)
    return torch.cat((torch.tensor([BOS]), body, torch.tensor([EOS])))


def decode(ids: torch.Tensor) -> bytes:
    return bytes(int(i) for i in ids if int(i) < 256)


def document_stream(files: list[SourceFile], seed: int, epochs: int | None = None) -> Iterator[torch.Tensor]:
    """Token documents in an order fixed by the seed, reshuffled each epoch; forever when epochs is None."""
    epoch = 0
    while epochs is None or epoch < epochs:
        order = list(range(len(files)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in order:
            with open(files[i].path, "rb") as fh:
                data = fh.read()
            if data:
                yield encode(data)
        epoch += 1


@dataclass
class PackedBatch:
    tokens: torch.Tensor  # (T,) int64 inputs
    targets: torch.Tensor  # (T,) int64: the next token of the same document, IGNORE_INDEX at each document's end
    cu_seqlens: torch.Tensor  # (docs + 1,) int32 document boundaries
    max_seqlen: int  # host int, so attention needs no device->host sync

    def to(self, device) -> PackedBatch:
        nb = torch.device(device).type == "cuda"
        return PackedBatch(
            self.tokens.to(device, non_blocking=nb),
            self.targets.to(device, non_blocking=nb),
            self.cu_seqlens.to(device, non_blocking=nb),
            self.max_seqlen,
        )

    @property
    def doc_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()


def make_batch(pieces: list[torch.Tensor]) -> PackedBatch:
    lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int32)
    cu = torch.zeros(len(pieces) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    tokens = torch.cat(pieces)
    targets = torch.roll(tokens, -1).clone()
    targets[cu[1:].long() - 1] = IGNORE_INDEX  # never predict across a document boundary
    return PackedBatch(tokens, targets, cu, int(lengths.max()))


def pack_documents(docs: Iterator[torch.Tensor], tokens_per_batch: int, max_doc_tokens: int | None = None
                   ) -> Iterator[PackedBatch]:
    """Fill batches of exactly tokens_per_batch tokens (the last one may be short when docs run out),
    in pieces of at most max_doc_tokens (default: the batch)."""
    if tokens_per_batch < 2:
        raise ValueError(f"tokens_per_batch must be >= 2, got {tokens_per_batch}")
    max_doc = min(max_doc_tokens or tokens_per_batch, tokens_per_batch)
    rest = None  # what is left of a document cut at the previous batch's end
    while True:
        pieces, used = [], 0
        while used < tokens_per_batch:
            if rest is None or len(rest) == 0:
                rest = next(docs, None)
                if rest is None:
                    break
            take = min(len(rest), tokens_per_batch - used, max_doc)
            pieces.append(rest[:take])
            rest, used = rest[take:], used + take
        if pieces:
            yield make_batch(pieces)
        if used < tokens_per_batch:
            return


def concat_documents(docs: Iterator[torch.Tensor], doc_tokens: int) -> Iterator[torch.Tensor]:
    """Long documents of exactly doc_tokens tokens, each the next files' tokens end to end (a file cut at
    a document's end continues the next one); a shorter last one when the files run out."""
    if doc_tokens < 2:
        raise ValueError(f"doc_tokens must be >= 2, got {doc_tokens}")
    parts, used = [], 0
    for d in docs:
        while len(d):
            take = min(len(d), doc_tokens - used)
            parts.append(d[:take])
            d, used = d[take:], used + take
            if used == doc_tokens:
                yield torch.cat(parts)
                parts, used = [], 0
    if parts:
        yield torch.cat(parts)


def _documents(files: list[SourceFile], seed: int, epochs: int | None, doc_tokens: int | None):
    docs = document_stream(files, seed, epochs)
    return concat_documents(docs, doc_tokens) if doc_tokens else docs


def train_batches(tokens_per_step: int, seed: int, files: list[SourceFile] | None = None,
                  max_doc_tokens: int | None = None, doc_tokens: int | None = None) -> Iterator[PackedBatch]:
    """doc_tokens: documents of that many tokens, concatenated from consecutive files (concat_documents)."""
    train, _ = split_corpus(files if files is not None else list_corpus_files())
    return pack_documents(_documents(train, seed, None, doc_tokens), tokens_per_step, max_doc_tokens)


def heldout_batches(num_batches: int, tokens_per_batch: int, files: list[SourceFile] | None = None,
                    max_doc_tokens: int | None = None, doc_tokens: int | None = None) -> list[PackedBatch]:
    """A fixed held-out evaluation set: the same for every run on a machine with the same settings."""
    _, heldout = split_corpus(files if files is not None else list_corpus_files())
    stream = pack_documents(_documents(heldout, HELDOUT_SEED, 1, doc_tokens), tokens_per_batch, max_doc_tokens)
    return list(itertools.islice(stream, num_batches))
