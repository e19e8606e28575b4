"""
The pretraining data loader (nanochat/dataloader.py): what it reads on any number of ranks, and its resume.

Shapes and dtypes, the data-slot property (2 ranks x accumulation 1 see exactly what 1 rank x accumulation 2
sees), disjoint documents across ranks, exact resume, best-fit BOS-aligned rows (no token lost). Ranks are
simulated in one process by building the loader with rank/world_size (the same code torchrun runs).
"""

import json
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import nanochat.dataloader
from nanochat.dataloader import DistributedTokenLoader, _BestFitBuffer
from nanochat.tokenizer import Tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bakers".split()


def doc_text(i):
    n = 5 + (i * 37) % 60  # documents of different lengths, 11 to 71 tokens: some longer than a row
    return f"doc{i:05d} " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n)) + "."


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter([doc_text(i) for i in range(300)]), 400)


@pytest.fixture
def corpus(isolated_env, monkeypatch):
    """A FineWeb-format corpus of 3 shards (2 train, 1 val), 3 row groups of 40 numbered docs each."""
    monkeypatch.setenv("NANOCHAT_DATASET", "fineweb-edu")
    monkeypatch.setenv("NANOCHAT_DATA_SHARDS", "3")
    directory = isolated_env / "base_data" / "fineweb-edu"
    directory.mkdir(parents=True)
    n = 0
    for shard in range(3):
        docs = [doc_text(n + i) for i in range(120)]
        n += 120
        pq.write_table(pa.table({"text": docs}), directory / f"shard_{shard:05d}.parquet", row_group_size=40)
    return directory


def make(tok, rank=0, world_size=1, B=2, T=16, total=None, split="train", state=None, bos_aligned=False):
    loader = DistributedTokenLoader(B=B, T=T, split=split, device="cpu", tokenizer=tok, rank=rank,
                                    world_size=world_size, total_batch_size=total, seed=0, bos_aligned=bos_aligned,
                                    tokenizer_threads=2, tokenizer_batch_size=8)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def doc_ids(tok, batch):
    return set(int(m) for m in re.findall(r"doc(\d{5})", tok.decode(batch[0].flatten().tolist())))


def test_shapes_dtypes_and_shift(tok, corpus):
    loader = make(tok, B=3, T=16)
    x1, y1 = next(loader)
    x2, y2 = next(loader)
    assert x1.shape == y1.shape == (3, 16) and x1.dtype == torch.int32 and y1.dtype == torch.int64
    flat_x = x1.flatten()
    flat_y = y1.flatten()
    assert torch.equal(flat_x[1:].long(), flat_y[:-1])  # targets are the inputs shifted by one, across rows too
    assert x2[0, 0].item() == y1[-1, -1].item()  # and across batches: no token is skipped
    assert x1[0, 0].item() == tok.get_bos_token_id()  # the stream starts at a document start


@pytest.mark.parametrize("bos_aligned", [False, True])
def test_slots_make_the_stream_world_size_invariant(tok, corpus, bos_aligned):
    B, T = 2, 16
    total = 2 * B * T
    single = make(tok, total=total, bos_aligned=bos_aligned)  # 1 rank, accumulation 2: slot 0 then slot 1
    # 2 ranks, accumulation 1
    ranks = [make(tok, rank=r, world_size=2, total=total, bos_aligned=bos_aligned) for r in range(2)]
    for step in range(250):  # long enough to cross units and an epoch of the training shards
        micro = [next(single) for _ in range(2)]
        per_rank = [next(r) for r in ranks]
        for a in range(2):
            assert torch.equal(micro[a][0], per_rank[a][0]) and torch.equal(micro[a][1], per_rank[a][1]), (step, a)
    assert single.epoch >= 1


def test_ranks_never_share_documents(tok, corpus):
    ranks = [make(tok, rank=r, world_size=3, total=3 * 2 * 16) for r in range(3)]
    seen = [set() for _ in ranks]
    for _ in range(15):
        for r, loader in enumerate(ranks):
            seen[r] |= doc_ids(tok, next(loader))
    assert all(seen)
    for a in range(3):
        for b in range(a + 1, 3):
            assert not (seen[a] & seen[b])
    assert max(max(s) for s in seen) < 240  # train split only: docs 240+ are in the validation shard


def test_more_slots_than_row_groups(tok, corpus):
    # 8 slots but only 6 train row groups: row groups are split so every slot still gets its own documents
    loaders = [make(tok, rank=r, world_size=8, total=8 * 2 * 16) for r in range(8)]
    seen = [set().union(*(doc_ids(tok, next(l)) for _ in range(4))) for l in loaders]
    assert all(seen)
    assert sum(len(s) for s in seen) == len(set().union(*seen))


@pytest.mark.parametrize("bos_aligned", [False, True])
def test_resume_returns_the_same_batches(tok, corpus, bos_aligned):
    total = 2 * 2 * 16
    for n in (1, 7, 330):  # 330: far enough to resume inside a later epoch and mid-document
        reference = make(tok, total=total, bos_aligned=bos_aligned)
        for _ in range(n):
            held = next(reference)
        state = json.loads(json.dumps(reference.state_dict()))  # as a checkpoint's meta file keeps it
        assert n < 330 or reference.epoch >= 1
        if bos_aligned and n > 1:  # best fit: resumed with a full buffer, leftovers (pieces cut) in it
            pieces = state["slots"]["0"]["pieces"]
            assert len(pieces) >= nanochat.dataloader.BESTFIT_BUFFER and any(start > 0 for *_, start, _ in pieces)
        expected = [held] + [next(reference) for _ in range(9)]
        resumed = make(tok, total=total, state=state, bos_aligned=bos_aligned)
        for e, got in zip(expected, (next(resumed) for _ in range(10))):
            assert torch.equal(e[0], got[0]) and torch.equal(e[1], got[1]), n


@pytest.mark.parametrize("bos_aligned", [False, True])
def test_state_merges_across_ranks(tok, corpus, bos_aligned):
    """The checkpoint keeps every rank's state; each rank picks its own slots back, on any number of ranks."""
    total = 2 * 2 * 16
    ranks = [make(tok, rank=r, world_size=2, total=total, bos_aligned=bos_aligned) for r in range(2)]
    for _ in range(5):
        held = [next(r) for r in ranks]
    merged = [r.state_dict() for r in ranks]  # what a checkpoint keeps: every rank's state_dict
    resumed = [make(tok, rank=r, world_size=2, total=total, state=merged, bos_aligned=bos_aligned) for r in range(2)]
    for h, r in zip(held, resumed):
        assert torch.equal(h[0], next(r)[0])
    # and a single process with accumulation 2 can continue from the 2-rank state
    single = make(tok, total=total, state=merged, bos_aligned=bos_aligned)
    assert torch.equal(next(single)[0], held[0][0]) and torch.equal(next(single)[0], held[1][0])


def test_bos_aligned_rows_start_at_documents(tok, corpus):
    loader = make(tok, B=4, T=24, bos_aligned=True)
    bos = tok.get_bos_token_id()
    for _ in range(10):
        x, y = next(loader)
        assert torch.all(x[:, 0] == bos)
        assert torch.equal(x[:, 1:].long(), y[:, :-1])
    assert loader.dropped_fraction() == 0


def test_best_fit_choices():
    """
    Rows begin with the longest whole document that fits, then take the longest piece that fits, else the
    shortest piece (to be cut); a document longer than a row comes in as a row and leftovers of half a row.
    """
    buffer = _BestFitBuffer(width=10)
    for i, n in enumerate([3, 7, 23, 4, 6, 2]):
        buffer.add(i, np.arange(n))
    pieces = [(where, start, end) for where, _, start, end in buffer.pieces.values()]
    assert pieces[2:6] == [(2, 0, 10), (2, 10, 15), (2, 15, 20), (2, 20, 23)]

    def take(space, first):
        where, _, start, end = buffer.take(space, first)
        return where, start, end

    assert take(10, first=True) == (2, 0, 10)  # the first row of document 2
    assert take(10, first=True) == (1, 0, 7)
    assert take(3, first=False) == (0, 0, 3)  # document 0 and the last leftover of document 2 tie: the earliest
    assert take(3, first=False) == (2, 20, 23)
    assert take(10, first=True) == (4, 0, 6)
    assert take(4, first=False) == (3, 0, 4)  # the leftovers of 5 tokens do not fit
    assert take(1, first=False) == (5, 0, 2)  # nothing fits one token: the shortest piece, to be cut
    buffer.add(6, np.arange(1))
    assert take(10, first=True) == (6, 0, 1)  # a row never begins with a leftover, even a longer one
    assert take(9, first=False) == (2, 10, 15)
    assert len(buffer) == 1


class RecordingTokenizer:
    """A tokenizer that keeps what it encoded: the documents the loader read, BOS first."""

    def __init__(self, tok):
        self.tok = tok
        self.encoded = []

    def get_bos_token_id(self):
        return self.tok.get_bos_token_id()

    def encode(self, texts, **kwargs):
        out = self.tok.encode(texts, **kwargs)
        self.encoded += out
        return out


def placed_and_buffered(loader, batches):
    """
    Counters of the tokens: in the rows of `batches` micro-batches (inputs and the last target of each row),
    waiting in the slot's best-fit buffer, and of the documents read into that buffer.
    """
    (slot,) = loader.slots
    placed = Counter()
    for _ in range(batches):
        x, y = next(loader)
        assert torch.all(x[:, 0] == loader.tokenizer.get_bos_token_id())
        placed.update(x.flatten().tolist() + y[:, -1].tolist())
    buffered = Counter(t for _, tokens, start, end in slot.bestfit.pieces.values() for t in tokens[start:end].tolist())
    pending = Counter(t for *_, tokens in slot.docs for t in tokens.tolist())  # read ahead, not yet in the buffer
    read = Counter(t for ids in loader.tokenizer.encoded for t in ids) - pending
    return placed, buffered, read


def test_best_fit_loses_no_token(tok, corpus):
    # rows of 65 tokens, documents of 11 to 71: some are cut, and their rest is placed later in other rows
    loader = DistributedTokenLoader(B=4, T=64, split="train", device="cpu", tokenizer=RecordingTokenizer(tok), rank=0,
                                    world_size=1, bos_aligned=True, tokenizer_threads=2, tokenizer_batch_size=8)
    placed, buffered, read = placed_and_buffered(loader, 60)
    assert loader.dropped_fraction() == 0 and 0 < loader.leftover_fraction() < 0.2
    assert placed + buffered == read  # every token read is in a row or still waiting: none lost, none twice
    assert sum(placed.values()) == 60 * 4 * 65


def test_best_fit_drops_only_when_documents_outgrow_rows(tok, corpus, monkeypatch):
    """
    Rows of 17 tokens, documents of 41 on average: every row starts a document, so the rows cannot hold all the
    tokens. The buffer stays bounded, full of leftovers; the shortest are dropped, counted; resuming stays exact.
    """
    monkeypatch.setattr(nanochat.dataloader, "BESTFIT_BUFFER", 50)
    loader = DistributedTokenLoader(B=2, T=16, split="train", device="cpu", tokenizer=RecordingTokenizer(tok), rank=0,
                                    world_size=1, bos_aligned=True, tokenizer_threads=2, tokenizer_batch_size=8)
    placed, buffered, read = placed_and_buffered(loader, 200)
    (slot,) = loader.slots
    assert len(slot.bestfit) <= 50 + 8 and 0 < loader.dropped_fraction() < 1  # + the 8 pieces of a 71-token document
    assert not placed + buffered - read  # nothing appears that was not read
    assert sum((read - placed - buffered).values()) == slot.tokens_dropped
    held = next(loader)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = [held] + [next(loader) for _ in range(4)]
    resumed = make(tok, T=16, state=state, bos_aligned=True)
    for e in expected:
        assert torch.equal(e[0], next(resumed)[0])


def test_positions_of_the_other_mode(tok, corpus):
    """A bos_aligned position saved before best fit (a document start) loads; the stream refuses a best-fit one."""
    from nanochat.output import UserError
    old = {"slots": {"0": [0, 1, 3, 0]}, "micro": 0}
    loader = make(tok, state=old, bos_aligned=True)
    next(loader)
    next(loader)
    pieces = loader.state_dict()["slots"]["0"]["pieces"]  # the buffer before the second batch
    assert pieces and min((epoch, unit, doc) for epoch, unit, doc, _, _ in pieces) >= (0, 1, 3)  # nothing before it
    with pytest.raises(UserError, match="bos_aligned=True"):
        make(tok, state=loader.state_dict())


def test_val_split_is_read_in_order_by_rank(tok, corpus):
    ranks = [make(tok, rank=r, world_size=2, split="val") for r in range(2)]
    ids = [doc_ids(tok, next(r)) for r in ranks]
    assert all(min(s) >= 240 for s in ids) and not (ids[0] & ids[1])
    assert min(ids[0]) == 240  # val is not shuffled: rank 0 starts at the first val document


def test_cuda_path_or_skip(tok, corpus):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here: the pinned-memory path is checked on a GPU machine")
    loader = DistributedTokenLoader(B=2, T=16, split="train", device="cuda", tokenizer=tok, rank=0, world_size=1)
    x, y = next(loader)
    assert x.is_cuda and x.dtype == torch.int32 and y.dtype == torch.int64


def test_indivisible_total_batch_is_a_user_error(tok, corpus):
    from nanochat.output import UserError
    with pytest.raises(UserError, match="not a multiple"):
        make(tok, world_size=2, total=3 * 2 * 16)
