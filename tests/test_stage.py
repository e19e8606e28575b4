"""
What nanochat/stage.py does, in-process and fast.

A resume's loop state, one set of metric names, when a stop made the stage end early, a non-finite loss or
weights, a resumed run's settings. The end-to-end resumes of each stage run the scripts (test_base_train,
test_training_core, test_chat_finetune).
"""

import json
import signal

import pytest
import torch

from nanochat.interrupt import Interrupted
from nanochat.output import UserError
from nanochat.stage import EXIT_STOPPED_EARLY, Stage, check_stage_settings
from nanochat.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return Tokenizer.from_directory(str(small_tokenizer_dir))


@pytest.fixture
def signal_handlers():
    """Stage.resume installs the stop request's handlers of SIGTERM and SIGINT: this process gets its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def stage_config(**overrides):
    return dict(dict(run="dummy", resume_from_step=-1, overwrite=False, dry_run=False), **overrides)


def tiny_gpt(tok):
    from nanochat.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(sequence_len=8, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=16))
    model.init_weights()
    return model


def test_a_resume_gets_the_loop_state_back_and_the_end_knows_whether_a_stop_cut_anything_short(
        isolated_env, tok, signal_handlers):
    stage = Stage("base", stage_config(), "cpu")
    model = tiny_gpt(tok)
    stage.start("tiny", model=model, tokenizer=tok)
    optimizers = model.setup_optimizers()
    loop = stage.resume(optimizers, None, {"corpus": "x"}, smooth_train_loss=0.0, rewards=[])
    assert vars(loop) == {"smooth_train_loss": 0.0, "rewards": []}  # a fresh run: the values given
    loop.smooth_train_loss = 1.5
    loop.rewards = [0.25]
    stage.log(0, val_bpb=2.0)
    stage.log(1, loss=1.5, step_loss=1.25)
    stage.save(1, optimizers, loop)
    stage.log(1, val_bpb=1.75)  # the resumed run evaluates its start step again: this line is dropped then
    stage.stop.requested = True  # a stop that came after everything: nothing was cut short
    assert not stage.stopped_early() and stage.finish(1, "next") == 0

    resumed = Stage("base", stage_config(resume_from_step=1), "cpu")
    model = tiny_gpt(tok)
    resumed.start("", model=model, tokenizer=tok)
    with pytest.raises(UserError, match="corpus"):
        resumed.resume(model.setup_optimizers(), None, {"corpus": "y"}, smooth_train_loss=0.0)
    loop = resumed.resume(model.setup_optimizers(), None, {"corpus": "x"}, smooth_train_loss=0.0, rewards=[],
                          min_val_bpb=float("inf"))
    # min_val_bpb was not saved: as given
    assert vars(loop) == {"smooth_train_loss": 1.5, "rewards": [0.25], "min_val_bpb": float("inf")}
    rows = [json.loads(line) for line in open(resumed.metrics_path)]
    assert rows == [{"step": 0, "val_bpb": 2.0}, {"step": 1, "loss": 1.5, "step_loss": 1.25}]  # one set of names
    resumed.stop.requested = True
    with resumed.phase("Step 00001 | evaluations"):  # a phase a stop request ends where it is
        if resumed.stop():
            raise Interrupted
        pytest.fail("the phase went on")
    assert resumed.stopped_early() and resumed.finish(1, "next") == EXIT_STOPPED_EARLY


def test_a_stop_agreed_at_the_end_of_a_step_ends_the_training_early(isolated_env, tok, signal_handlers):
    stage = Stage("base", stage_config(), "cpu")
    model = tiny_gpt(tok)
    stage.start("tiny", model=model, tokenizer=tok)
    stage.resume(model.setup_optimizers(), None, {"corpus": "x"})
    assert stage.stop_after_step(False, True) == (False, False, True)  # the flags, agreed by every rank
    stage.stop.requested = True  # a signal (StopRequest's handler)
    assert stage.stop_after_step() == (True,)
    assert stage.stop() and stage.stopped_early()


def test_a_diverged_run_is_stopped_and_never_saved(isolated_env, tok, signal_handlers):
    stage = Stage("base", stage_config(matrix_lr=0.02), "cpu")
    model = tiny_gpt(tok)
    stage.start("tiny", model=model, tokenizer=tok)
    optimizers = model.setup_optimizers()
    loop = stage.resume(optimizers, None, {"corpus": "x"}, smooth_train_loss=0.0)
    stage.save(1, optimizers, loop)
    with pytest.raises(UserError,
                       match=r"step 2: step loss nan is not finite.*the last checkpoint is step 1.*--matrix_lr"):
        stage.log(2, step_loss=float("nan"), grad_norm=1.0)
    with pytest.raises(UserError, match=r"step 2: grad norm inf is not finite"):
        stage.log(2, step_loss=1.0, grad_norm=float("inf"))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(UserError, match="step 2: the weights are not finite; nothing saved"):
        stage.save(2, optimizers, loop)
    assert sorted(p.name for p in (isolated_env / "base_checkpoints" / "tiny").glob("meta_*")) == ["meta_000001.json"]


def test_shared_settings_are_checked_before_any_work():
    good = stage_config(warmup_ratio=0.2, warmdown_ratio=0.8)
    check_stage_settings(good)
    with pytest.raises(UserError, match="--resume_from_step must be"):
        check_stage_settings(dict(good, resume_from_step=-3))
    with pytest.raises(UserError, match=r"--warmup_ratio \+ --warmdown_ratio = 1.1 > 1"):
        check_stage_settings(dict(good, warmup_ratio=0.3))
    with pytest.raises(UserError, match="is not a plain name"):
        check_stage_settings(dict(good, model_tag="../escape"))
