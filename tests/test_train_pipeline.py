"""The training-validation pipeline (train/) end to end on the CPU: tiny model, emulator backend."""

import csv
import itertools
import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # train/ is a repo-root folder

from train import data, eval_leakage, run  # noqa: E402
from train.model import AttentionSpec, Decoder, positions_in_documents, preset  # noqa: E402

TOKENS = 256


@pytest.fixture(scope="module")
def corpus():
    return data.list_corpus_files()


def tiny_model(spec=None, seed=0):
    torch.manual_seed(seed)
    return Decoder(preset("tiny", data.VOCAB_SIZE), spec or AttentionSpec("sdpa"))


def batch_loss(model, b):
    return F.cross_entropy(model(b.tokens, b.cu_seqlens, b.max_seqlen).float(), b.targets, ignore_index=data.IGNORE_INDEX)


# ---- data -------------------------------------------------------------------------------------------


def test_pack_documents_cu_seqlens_match_document_lengths():
    lengths = [5, 40, 3, 100, 1, 17, 64, 2]
    docs = [torch.arange(n) + 1000 * i for i, n in enumerate(lengths)]  # token // 1000 = source document
    batches = list(data.pack_documents(iter(docs), 64, max_doc_tokens=48))
    assert all(b.tokens.numel() == 64 for b in batches[:-1])
    assert torch.equal(torch.cat([b.tokens for b in batches]), torch.cat(docs))  # nothing lost, order kept
    pieces_per_doc = [0] * len(lengths)
    for b in batches:
        cu = b.cu_seqlens
        assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == b.tokens.numel()
        assert b.max_seqlen == max(b.doc_lengths) <= 48
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            ids = b.tokens[s:e] // 1000
            assert (ids == ids[0]).all(), "a packed document mixes two source documents"
            pieces_per_doc[int(ids[0])] += e - s
            assert torch.equal(b.targets[s : e - 1], b.tokens[s + 1 : e])  # next token, same document
            assert int(b.targets[e - 1]) == data.IGNORE_INDEX  # never across a boundary
    assert pieces_per_doc == lengths


def test_concat_documents_makes_exact_long_documents_in_order():
    docs = [torch.arange(n) + 1000 * i for i, n in enumerate([5, 40, 3, 100, 1, 17, 64, 2])]
    long = list(data.concat_documents(iter(docs), 50))
    assert [len(d) for d in long] == [50, 50, 50, 50, 32]  # 232 tokens: the last one shorter
    assert torch.equal(torch.cat(long), torch.cat(docs))  # nothing lost, order kept
    with pytest.raises(ValueError, match="doc_tokens"):
        next(data.concat_documents(iter(docs), 1))


def test_long_document_batches_from_the_corpus(corpus):
    """--doc-tokens: every document of a batch has exactly doc_tokens tokens and spans several files (their
    BOS tokens inside), packed four to a batch; deterministic, and the held-out set built the same way."""
    batches = list(itertools.islice(data.train_batches(4096, seed=3, files=corpus, max_doc_tokens=1024,
                                                       doc_tokens=1024), 16))
    b = batches[0]
    assert all(x.doc_lengths == [1024] * 4 and x.max_seqlen == 1024 for x in batches)
    assert int(b.tokens[0]) == data.BOS
    # files concatenated: files start inside documents, and a document's targets cross them
    inside = [bool((x.tokens.view(4, 1024)[:, 1:] == data.BOS).any()) for x in batches]
    assert any(inside)
    again = next(data.train_batches(4096, seed=3, files=corpus, max_doc_tokens=1024, doc_tokens=1024))
    assert torch.equal(b.tokens, again.tokens)
    (held,) = data.heldout_batches(1, 2048, files=corpus, doc_tokens=1024)
    assert held.doc_lengths == [1024, 1024]


def test_doc_tokens_options_of_a_run():
    limits = lambda *argv: run.doc_limits(run.parse_args(list(argv)))
    assert limits() == (4096, None)
    assert limits("--doc-tokens", "16384") == (16384, 16384)
    assert limits("--doc-tokens", "2048", "--max-doc-tokens", "4096") == (4096, 2048)
    with pytest.raises(SystemExit, match="cut"):
        limits("--doc-tokens", "16384", "--max-doc-tokens", "4096")


def test_long_document_run_reports_throughput(tmp_path):
    summary = run.main(["--attention", "sdpa", "--preset", "tiny", "--steps", "3", "--tokens-per-step", "256",
                        "--doc-tokens", "128", "--eval-batches", "1", "--eval-every", "0", "--leak-samples", "0",
                        "--timing-warmup", "1", "--out", str(tmp_path)])
    assert summary["doc_tokens"] == 128 and summary["max_doc_tokens"] == 128
    tp = summary["throughput"]
    assert tp["timed_steps"] == 2 and tp["tokens_per_s"] > 0 and tp["peak_mem_mb"] is None  # no GPU memory here
    with open(tmp_path / f"{summary['run']}.csv", newline="") as fh:
        assert set(run.CSV_FIELDS) == set(next(csv.DictReader(fh)))
    assert "tokens/s" in run.main(["--compare", str(tmp_path)])


def test_real_corpus_batches_are_documents_and_deterministic(corpus):
    first = [next(data.train_batches(512, seed=3, files=corpus)) for _ in range(2)]
    assert torch.equal(first[0].tokens, first[1].tokens) and torch.equal(first[0].cu_seqlens, first[1].cu_seqlens)
    other = next(data.train_batches(512, seed=4, files=corpus))
    assert not torch.equal(first[0].tokens, other.tokens)
    b = first[0]
    assert b.tokens.numel() == 512 and int(b.tokens.max()) < data.VOCAB_SIZE
    cu = b.cu_seqlens.tolist()
    # Only the batch's edges can be pieces of a cut document: every inner boundary is EOS | BOS.
    for boundary in cu[1:-1]:
        assert int(b.tokens[boundary - 1]) == data.EOS and int(b.tokens[boundary]) == data.BOS


def test_train_heldout_split_is_disjoint_by_file(corpus):
    train, heldout = data.split_corpus(corpus)
    names_train, names_held = {f.name for f in train}, {f.name for f in heldout}
    assert names_train.isdisjoint(names_held) and len(train) + len(heldout) == len(corpus)
    assert 0.005 < len(heldout) / len(corpus) < 0.05
    assert any(n.startswith("torch/") for n in names_train) and any(n.startswith("stdlib/") for n in names_train)
    assert data.split_corpus(corpus) == (train, heldout)


# ---- model ------------------------------------------------------------------------------------------


def test_rotary_positions_restart_at_every_document():
    cu = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)  # includes an empty document
    assert positions_in_documents(cu, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


SPECS = {"sdpa": AttentionSpec("sdpa"), "flamia-fp8_tokenblock": AttentionSpec("flamia", "fp8_tokenblock", "emulate")}


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_document_logits_do_not_depend_on_packing(spec):
    """Positions restart per document and nothing crosses documents: a document packed after another
    gives the logits it gives alone."""
    model = tiny_model(spec).eval()
    g = torch.Generator().manual_seed(0)
    doc_a, doc_b = torch.randint(0, 256, (70,), generator=g), torch.randint(0, 256, (150,), generator=g)
    with torch.no_grad():
        alone = model(doc_a, torch.tensor([0, 70], dtype=torch.int32), 70)
        packed = model(torch.cat((doc_b, doc_a)), torch.tensor([0, 150, 220], dtype=torch.int32), 150)
    torch.testing.assert_close(packed[150:], alone, atol=1e-4, rtol=1e-4)


def test_sdpa_and_flamia_bf16_give_close_losses_and_grads(corpus):
    b = next(data.train_batches(TOKENS, seed=0, files=corpus))
    model = tiny_model()
    results = {}
    for spec in (AttentionSpec("sdpa"), AttentionSpec("flamia", "bf16", "emulate")):
        model.set_attention(spec)
        model.zero_grad()
        loss = batch_loss(model, b)
        loss.backward()
        results[spec.kind] = (float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()]))
    (loss_s, grad_s), (loss_f, grad_f) = results["sdpa"], results["flamia"]
    assert abs(loss_s - loss_f) < 5e-3
    assert float((grad_f - grad_s).norm() / grad_s.norm()) < 2e-2


def test_default_recipe_grads_close_to_bf16_on_packed_batch(corpus):
    b = next(data.train_batches(TOKENS, seed=0, files=corpus))
    model = tiny_model()
    grads = []
    for recipe in ("bf16", "fp8_tokenblock"):
        model.set_attention(AttentionSpec("flamia", recipe, "emulate"))
        model.zero_grad()
        batch_loss(model, b).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[1] - grads[0]).norm() / grads[0].norm()) < 0.1


# ---- training, comparison, causal evaluation ---------------------------------------------------------

RUN_ARGS = ["--preset", "tiny", "--steps", "8", "--tokens-per-step", str(TOKENS), "--repeat-batch", "--lr", "3e-3",
            "--warmup-steps", "1", "--eval-batches", "1", "--eval-every", "4", "--leak-samples", "8", "--log-every", "4"]
RUNS = {"flamia-fp8_tokenblock-s0": ["--attention", "flamia", "--recipe", "fp8_tokenblock", "--backend", "emulate"],
        "sdpa-s0": ["--attention", "sdpa"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    summaries = {name: run.main([*extra, *RUN_ARGS, "--out", str(out), "--save-model"]) for name, extra in RUNS.items()}
    return out, summaries


@pytest.mark.parametrize("name", sorted(RUNS))
def test_training_loss_finite_and_decreasing(trained, name):
    out, summaries = trained
    with open(out / f"{name}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    losses = [float(r["train_loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5 and sum(losses[-3:]) < sum(losses[:3])  # fits the repeated batch
    assert all(float(r["attn_ms"]) > 0 and float(r["tokens_per_s"]) > 0 for r in rows)
    assert [r["step"] for r in rows if r["heldout_loss"]] == ["4", "8"]
    summary = json.loads((out / f"{name}.summary.json").read_text())
    assert summary == json.loads(json.dumps(summaries[name]))
    assert math.isfinite(summary["heldout_loss"]) and summary["diverged_at"] is None


@pytest.mark.parametrize("name", sorted(RUNS))
def test_causal_heldout_eval_agrees_for_leak_free_attention(trained, name):
    leak = trained[1][name]["leakage"]
    assert leak["samples"] == 8
    assert math.isfinite(leak["loss_causal"]) and abs(leak["gap"]) < 1e-4


def test_causal_eval_detects_a_leaky_recipe():
    """Positive control: with tensor-wide scales the parallel pass depends on later tokens; the check sees it.

    Power-of-two scales hide small amax changes, so the future is made loud: token SPIKE alone feeds one
    channel, amplified 1000x by the first norm, so its keys and values dwarf everyone else's."""
    spike, channel = 250, 0
    g = torch.Generator().manual_seed(0)
    doc = torch.cat((torch.tensor([data.BOS]), torch.randint(0, 200, (229,), generator=g), torch.full((26,), spike)))
    batch = data.make_batch([doc])
    diffs = {}
    for recipe in ("fp8_tokenblock", "fp8_tensor_current"):
        model = tiny_model(AttentionSpec("flamia", recipe, "emulate"))
        with torch.no_grad():
            model.embed.weight[:, channel] = 0.0
            model.embed.weight[spike, channel] = 1.0
            model.blocks[0].attn_norm.weight[channel] = 1000.0
        leak = eval_leakage.causal_gap(model, [batch], torch.device("cpu"), samples=8, max_prefix=230)
        diffs[recipe] = leak["mean_abs_diff"]
    assert diffs["fp8_tokenblock"] < 1e-5 and diffs["fp8_tensor_current"] > 2e-4  # measured: 0 and 1.1e-3


def test_compare_table_and_eval_cli(trained, capsys):
    out, _ = trained
    table = run.main(["--compare", str(out)])
    assert "control: sdpa-s0" in table and all(name in table for name in RUNS)
    result = eval_leakage.main(["--checkpoint", str(out / "flamia-fp8_tokenblock-s0.pt"), "--attention", "sdpa",
                                "--samples", "4", "--eval-batches", "1"])
    assert result["evaluated_with"]["kind"] == "sdpa" and result["samples"] == 4 and math.isfinite(result["heldout_loss"])


def test_lr_schedule_warms_up_then_decays_to_min():
    lrs = [run.lr_at(s, 100, 1e-3, 10, 0.1) for s in range(1, 101)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(lrs[i] >= lrs[i + 1] for i in range(9, 99)) and lrs[-1] == pytest.approx(1e-4)
