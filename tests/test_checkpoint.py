"""Checkpoints (nanochat/checkpoint_manager.py): an exact round trip, a resume's checks, broken files, tags."""

import os
import types

import pytest
import torch

from nanochat.checkpoint_manager import (build_model, complete_steps, find_model_tag, load_checkpoint, load_for_resume,
                                         load_optimizer_shards, optimizer_shard, save_checkpoint)
from nanochat.gpt import GPT, GPTConfig
from nanochat.output import UserError


def trained_model_and_optimizers():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
    model.init_weights()
    optimizers = model.setup_optimizers()
    for _ in range(2):
        idx = torch.randint(0, 128, (2, 16))
        model(idx, idx).backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
    return model, optimizers


def save(tmp_path, model, optimizers, step=5):
    meta = dict(model_config=model.config.to_dict(), user_config=dict(depth=2), loop_state=dict(ema=1.5))
    save_checkpoint(str(tmp_path), step, model.state_dict(), optimizer_shard(optimizers, model), meta)


def test_round_trip_is_exact(tmp_path):
    tmp_path = tmp_path / "checkpoint"  # apart from the test's base dir, which the compute dtype's probe may write to
    model, optimizers = trained_model_and_optimizers()
    save(tmp_path, model, optimizers)
    assert sorted(os.listdir(tmp_path)) == ["meta_000005.json", "model_000005.pt", "optim_000005_rank0.pt"]
    model_state, optim_shards, meta = load_checkpoint(str(tmp_path), 5, "cpu", load_optimizer=True)
    assert meta["step"] == 5 and meta["world_size"] == 1 and meta["loop_state"] == dict(ema=1.5)
    for k, v in model.state_dict().items():
        assert torch.equal(model_state[k], v)
    rebuilt, _ = build_model(str(tmp_path), 5, "cpu", phase="eval")
    assert not rebuilt.training
    idx = torch.randint(0, 128, (2, 16))
    assert torch.equal(rebuilt(idx), model(idx))  # weights and rotary tables identical
    # optimizer state continues exactly: load into fresh optimizers, take the same step on both
    _, fresh_opts = trained_model_and_optimizers()
    fresh_model = rebuilt.train()
    fresh_opts = fresh_model.setup_optimizers()
    load_optimizer_shards(fresh_opts, fresh_model, optim_shards)
    for m, opts in ((model, optimizers), (fresh_model, fresh_opts)):
        m(idx, idx).backward()
        for opt in opts:
            opt.step()
    for (k, a), b in zip(model.state_dict().items(), fresh_model.state_dict().values()):
        assert torch.equal(a, b), k


def test_resume_loads_only_into_a_model_of_the_checkpoints_config(tmp_path):
    """
    load_for_resume: the weights into the model a run built, every saving rank's optimizer state; a model built
    with other settings is refused naming each field that differs, and so is another tokenizer.
    """
    model, optimizers = trained_model_and_optimizers()
    save(tmp_path, model, optimizers)
    tokenizer = types.SimpleNamespace(fingerprint=lambda: "any", get_vocab_size=lambda: 128, directory="tok")
    built = GPT(GPTConfig(sequence_len=16, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
    loaded, tok, shards, meta = load_for_resume(str(tmp_path), 5, "cpu", built, tokenizer)
    assert loaded is built and tok is tokenizer and len(shards) == 1 and meta["step"] == 5
    for k, v in model.state_dict().items():
        assert torch.equal(built.state_dict()[k], v), k
    other = GPT(GPTConfig(sequence_len=16, vocab_size=128, n_layer=1, n_head=2, n_kv_head=1, n_embd=32))
    with pytest.raises(UserError, match=r"step 5 in .* has a different model: n_layer 2 \(this run 1\), n_embd 64 "
                                        r"\(this run 32\); resume with the settings of that run"):
        load_for_resume(str(tmp_path), 5, "cpu", other, tokenizer)
    with pytest.raises(UserError, match="was trained with tokenizer .* is any \\(vocab 64\\)"):
        load_for_resume(str(tmp_path), 5, "cpu", built, types.SimpleNamespace(
            fingerprint=lambda: "any", get_vocab_size=lambda: 64, directory="tok"))


def test_truncated_file_is_a_clear_error(tmp_path):
    model, optimizers = trained_model_and_optimizers()
    save(tmp_path, model, optimizers)
    path = tmp_path / "model_000005.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="model_000005.pt is unreadable"):
        load_checkpoint(str(tmp_path), 5, "cpu")
    os.remove(path)
    with pytest.raises(UserError, match="checkpoint file missing: .*model_000005.pt"):
        load_checkpoint(str(tmp_path), 5, "cpu")


def test_interrupted_save_is_not_the_last_step(tmp_path, monkeypatch):
    model, optimizers = trained_model_and_optimizers()
    save(tmp_path, model, optimizers, step=5)
    import nanochat.checkpoint_manager as cm

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # killed after the weights were written, while writing the marker

    monkeypatch.setattr(cm.json, "dump", crash)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, model, optimizers, step=10)
    assert not os.path.exists(tmp_path / "model_000010.pt")  # a failed save removes what it wrote
    assert complete_steps(str(tmp_path)) == [5]  # step 10 has no meta file: not a checkpoint
    with pytest.raises(UserError, match="no complete checkpoint of step 10"):
        load_checkpoint(str(tmp_path), 10, "cpu")
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_model_tag_is_never_guessed(tmp_path):
    with pytest.raises(UserError, match="no checkpoints directory"):
        find_model_tag(str(tmp_path / "base_checkpoints"))
    (tmp_path / "base_checkpoints" / "d4").mkdir(parents=True)
    assert find_model_tag(str(tmp_path / "base_checkpoints")) == "d4"
    (tmp_path / "base_checkpoints" / "d6").mkdir()
    (tmp_path / "base_checkpoints" / ".d8.tmp123").mkdir()  # an import being written: not a model
    with pytest.raises(UserError, match="several models .*d4, d6; choose one with --model_tag"):
        find_model_tag(str(tmp_path / "base_checkpoints"))
    assert complete_steps(str(tmp_path / "base_checkpoints" / "d4")) == []


def test_a_checkpoint_directory_may_carry_its_own_tokenizer(isolated_env):
    """
    An imported model's tokenizer lives in <checkpoint_dir>/tokenizer/; load_model and the token bytes use it,
    and carry_tokenizer passes it on to the checkpoints trained from it (the base dir's needs no copy).
    """
    from nanochat.checkpoint_manager import checkpoint_dir_for, load_model
    from nanochat.tokenizer import Tokenizer, carry_tokenizer, get_token_bytes
    own = Tokenizer({bytes([i]): i for i in range(256)})  # no tokenizer in the base dir at all
    model = GPT(GPTConfig(sequence_len=16, vocab_size=own.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1,
                          n_embd=64))
    model.init_weights()
    ckpt = checkpoint_dir_for("sft", "imported")
    carry_tokenizer(own, ckpt)
    meta = dict(model_config=model.config.to_dict(),
                tokenizer=dict(fingerprint=own.fingerprint(), vocab_size=own.get_vocab_size()))
    save_checkpoint(ckpt, 0, model.state_dict(), None, meta)
    _, tokenizer, _ = load_model("sft", "cpu", phase="eval")
    assert tokenizer.fingerprint() == own.fingerprint() and tokenizer.directory == os.path.join(ckpt, "tokenizer")
    assert torch.equal(get_token_bytes(directory=tokenizer.directory), own.compute_token_bytes())
    # a model trained from the base dir's tokenizer into that directory: the stale copy goes, nothing is written
    base_tokenizer = Tokenizer({**own.mergeable_ranks, b"ab": 256})
    base_tokenizer.save(str(isolated_env / "tokenizer"))
    carry_tokenizer(Tokenizer.from_directory(str(isolated_env / "tokenizer")), ckpt)
    assert not os.path.exists(os.path.join(ckpt, "tokenizer"))
    # the fingerprint check names the directory the tokenizer came from
    with pytest.raises(UserError, match=f"but the tokenizer in {isolated_env / 'tokenizer'} is"):
        load_model("sft", "cpu", phase="eval")
