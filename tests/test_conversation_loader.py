"""
The conversation loader of the chat stages (nanochat/conversation_loader.py: ConversationLoader, padded_batch).

Packed and padded rows, ranks reading disjoint conversations, exact continuation from a state_dict, also across the
end of an epoch.
"""

import pytest
import torch

from nanochat.conversation_loader import ConversationLoader, padded_batch
from nanochat.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return Tokenizer.from_directory(str(small_tokenizer_dir))


def conversation(i, length):
    """Conversation i: a user turn naming it, an assistant answer of about `length` words."""
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": " ".join(f"w{i}x{k}" for k in range(length))}]}


DATASET = [conversation(i, 3 + (7 * i) % 23) for i in range(13)]  # lengths vary: some span rows, some do not


def batches(loader, n):
    return [next(loader) for _ in range(n)]


def same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("packed", [True, False])
def test_conversation_loader_continues_exactly_from_its_state(tok, packed):
    T = 16
    reference = ConversationLoader(DATASET, tok, 2, T, "cpu", packed=packed)
    expected = batches(reference, 40)  # several epochs of 13 conversations: resumes land mid-epoch and mid-conversation
    assert reference.epoch_done
    for k in (0, 1, 5, 17, 31):
        first = ConversationLoader(DATASET, tok, 2, T, "cpu", packed=packed)
        batches(first, k)
        state = first.state_dict()
        resumed = ConversationLoader(DATASET, tok, 2, T, "cpu", packed=packed)
        resumed.load_state_dict([state])  # a checkpoint keeps every rank's state: here one rank
        same(batches(resumed, 40 - k), expected[k:])
        assert resumed.stats["read"] == reference.stats["read"] and resumed.epoch_done == reference.epoch_done


def test_packed_rows_are_full_shifted_and_masked(tok):
    loader = ConversationLoader(DATASET, tok, 2, 16, "cpu", packed=True)
    x1, y1 = next(loader)
    full = ConversationLoader(DATASET, tok, 2, 16, "cpu", packed=True, train_on_all_tokens=True)
    _, y_all = next(full)
    x2, _ = next(full)
    assert (y_all != -1).all() and x2[0, 0].item() == y_all[-1, -1].item()  # the next batch starts with the last target
    assert x1.shape == y1.shape == (2, 16) and x1.dtype == torch.int32 and y1.dtype == torch.int64
    assert x1[0, 0].item() == tok.get_bos_token_id()  # the stream starts where conversation 0 starts
    ids, mask = tok.render_conversation(DATASET[0], max_tokens=10**9)
    n = min(len(ids) - 1, 32)
    flat_y = y1.flatten()[:n].tolist()
    assert flat_y == [t if m else -1 for t, m in zip(ids[1:n + 1], mask[1:n + 1])]  # targets: next token where trained


def test_padded_rows_hold_one_conversation_each(tok):
    loader = ConversationLoader(DATASET, tok, 3, 8, "cpu", packed=False)
    x, y = next(loader)
    rows = [tok.render_conversation(DATASET[i], max_tokens=10**9) for i in range(3)]
    assert x.shape[1] == max(min(len(ids), 9) for ids, _ in rows) - 1
    for r, (ids, mask) in enumerate(rows):
        ids, mask = ids[:9], mask[:9]
        assert x[r, :len(ids) - 1].tolist() == ids[:-1]
        assert y[r, :len(ids) - 1].tolist() == [t if m else -1 for t, m in zip(ids[1:], mask[1:])]
        assert (y[r, len(ids) - 1:] == -1).all()  # padding is never a target
    assert loader.stats["cut"] == sum(len(ids) > 9 for ids, _ in rows)


def test_ranks_read_disjoint_conversations_and_each_continues_its_own(tok):
    loaders = [ConversationLoader(DATASET, tok, 1, 8, "cpu", packed=False, rank=r, world_size=3) for r in range(3)]
    for loader in loaders:
        batches(loader, 2)
    assert [loader.stats["first"] for loader in loaders] == [[0, 3], [1, 4], [2, 5]]
    states = [loader.state_dict() for loader in loaders]
    expected = [batches(loader, 3) for loader in loaders]
    for r in range(3):
        resumed = ConversationLoader(DATASET, tok, 1, 8, "cpu", packed=False, rank=r, world_size=3)
        resumed.load_state_dict(states)
        same(batches(resumed, 3), expected[r])


def test_padded_batch():
    x, y = padded_batch([([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 0])], pad_id=0, device="cpu")
    assert x.tolist() == [[5, 6], [8, 0]] and x.dtype == torch.int32
    assert y.tolist() == [[6, 7], [-1, -1]]
