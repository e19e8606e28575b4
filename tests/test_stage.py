"""
The pieces every training stage shares, in-process and fast: the conversation loader (packed and padded rows,
ranks reading disjoint conversations, exact continuation from a state_dict, also across the end of an epoch),
pad_rows, the one learning-rate schedule with each stage's defaults, and the stage's checks (non-finite loss or
weights, a resumed run's settings). The end-to-end resumes of each stage run the scripts (test_base_train,
test_training_core, test_chat_finetune).
"""

import pytest
import torch

from nanochat.common import UserError, any_rank, gather_from_ranks, per_rank, sum_over_ranks
from nanochat.dataloader import ConversationLoader, pad_rows
from nanochat.hardware import compile_model
from nanochat.optim import lr_multiplier, scale_initial_lrs, set_learning_rates
from nanochat.stage import Stage, check_stage_settings
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
    (_, y_all), (x2, _) = next(full), next(full)
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


def test_pad_rows():
    x, y = pad_rows([([5, 6, 7], [0, 1, 1]), ([8, 9], [1, 0])], pad_id=0, device="cpu")
    assert x.tolist() == [[5, 6], [8, 0]] and x.dtype == torch.int32
    assert y.tolist() == [[6, 7], [-1, -1]]


def test_one_schedule_with_each_stages_defaults():
    # SFT and RL (warmdown_ratio=1): a linear decay from 1 at the first step to 0 at the end
    assert [lr_multiplier(s, 4, 0.0, 1.0) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    # midtraining of one epoch: the progress is conversations read out of the epoch's, decay over the last 20%
    assert lr_multiplier(500, 1000) == 1.0 and lr_multiplier(900, 1000) == pytest.approx(0.5)
    assert lr_multiplier(1000, 1000, final_lr_frac=0.1) == pytest.approx(0.1)
    model = torch.nn.Linear(2, 2)
    adam = torch.optim.AdamW(model.parameters(), lr=0.2)
    from nanochat.muon import Muon
    muon = Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.02, momentum=0.95)
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    scale_initial_lrs([adam, muon], 0.5)
    set_learning_rates([adam, muon], 0.5, 0.9)
    assert adam.param_groups[0]["lr"] == pytest.approx(0.05) and muon.param_groups[0]["lr"] == pytest.approx(0.005)
    assert muon.param_groups[0]["momentum"] == 0.9 and "momentum" not in adam.param_groups[0]


def test_rank_agreement_in_one_process():
    assert any_rank(False, True) == (False, True)
    assert per_rank(2.5) == [2.5] and sum_over_ranks(1, 2.5) == (1.0, 2.5) and gather_from_ranks({"a": 1}) == [{"a": 1}]


def test_compile_auto_is_on_for_cuda_only():
    model = torch.nn.Linear(2, 2)
    assert compile_model(model, "auto", "cpu") == (model, False)
    assert compile_model(model, "false", "cuda") == (model, False)


def stage_config(**overrides):
    return dict(dict(run="dummy", resume_from_step=-1, overwrite=False, dry_run=False), **overrides)


def test_a_diverged_run_is_stopped_and_never_saved(isolated_env, tok):
    from nanochat.gpt import GPT, GPTConfig
    stage = Stage("base", stage_config(), "cpu")
    model = GPT(GPTConfig(sequence_len=8, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=16))
    model.init_weights()
    stage.start("tiny", model=model, tokenizer=tok)
    optimizers = model.setup_optimizers()
    stage.resume(optimizers, {"corpus": "x"})
    stage.save(1, optimizers, loop_state={})
    with pytest.raises(UserError, match=r"step 2: loss nan is not finite.*the last checkpoint is step 1.*--matrix_lr"):
        stage.check_finite(2, float("nan"), 1.0, ["matrix_lr"])
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(UserError, match="step 2: the weights are not finite; nothing saved"):
        stage.save(2, optimizers, loop_state={})
    assert sorted(p.name for p in (isolated_env / "base_checkpoints" / "tiny").glob("meta_*")) == ["meta_000001.json"]


def test_shared_settings_are_checked_before_any_work():
    good = stage_config(warmup_ratio=0.2, warmdown_ratio=0.8)
    check_stage_settings(good)
    with pytest.raises(UserError, match="--resume_from_step must be"):
        check_stage_settings(dict(good, resume_from_step=-3))
    with pytest.raises(UserError, match=r"--warmup_ratio \+ --warmdown_ratio = 1.1 > 1"):
        check_stage_settings(dict(good, warmup_ratio=0.3))
