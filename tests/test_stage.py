"""
What nanochat/stage.py does, in-process and fast.

A resume's loop state, one set of metric names, when a stop made the stage end early, a non-finite loss or
weights, a resumed run's settings; the stage's settings, declared once and taken by every training script with the
same config (and so the same fingerprints) as when each script declared them. The end-to-end resumes of each stage
run the scripts (test_base_train, test_training_core, test_chat_finetune).
"""

import hashlib
import json
import signal

import pytest
import torch

from helpers import given_to_stage, stage_config
from nanochat import stage as stage_module
from nanochat.interrupt import Interrupted
from nanochat.output import UserError
from nanochat.report import get_report
from nanochat.rerun import checkpoint_input, corpus_input, file_input, fingerprint, tokenizer_input
from nanochat.stage import EXIT_STOPPED_EARLY, Stage, check_stage_settings, stage_settings
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


@pytest.fixture
def on_cpu(monkeypatch):
    """Stage.start_compute in this process: compute_init's answer for one CPU process, without its set-up."""
    monkeypatch.setattr(stage_module, "compute_init", lambda device_type: (False, 0, 0, 1, torch.device("cpu")))


def started(config, **kwargs):
    """A base Stage (it reads the test's tokenizer and corpus) with its compute started."""
    stage = Stage("base", config, **kwargs)
    assert stage.start_compute() == ("cpu", False, 0, 1, torch.device("cpu"))
    return stage


def tiny_gpt(tok):
    from nanochat.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(sequence_len=8, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1, n_embd=16))
    model.init_weights()
    return model


def test_a_resume_gets_the_loop_state_back_and_the_end_knows_whether_a_stop_cut_anything_short(
        trained_tokenizer, tok, signal_handlers, on_cpu):
    stage = started(stage_config(), model_tag="tiny")
    model = tiny_gpt(tok)
    stage.start(model=model, tokenizer=tok)
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

    resumed = started(stage_config(resume_from_step=1))  # --model_tag empty: the only one there
    model = tiny_gpt(tok)
    resumed.start(model=model, tokenizer=tok)
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


def test_a_stop_agreed_at_the_end_of_a_step_ends_the_training_early(trained_tokenizer, tok, signal_handlers, on_cpu):
    stage = started(stage_config(), model_tag="tiny")
    model = tiny_gpt(tok)
    stage.start(model=model, tokenizer=tok)
    stage.resume(model.setup_optimizers(), None, {"corpus": "x"})
    assert stage.stop_after_step(False, True) == (False, False, True)  # the flags, agreed by every rank
    stage.stop.requested = True  # a signal (StopRequest's handler)
    assert stage.stop_after_step() == (True,)
    assert stage.stop() and stage.stopped_early()


def test_a_diverged_run_is_stopped_and_never_saved(trained_tokenizer, isolated_env, tok, signal_handlers, on_cpu):
    stage = started(stage_config(matrix_lr=0.02), model_tag="tiny")
    model = tiny_gpt(tok)
    stage.start(model=model, tokenizer=tok)
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
    with pytest.raises(UserError, match="--device_type must be one of '', cuda, cpu, mps, got 'gpu'"):
        check_stage_settings(dict(good, device_type="gpu"))


def test_a_stage_takes_its_own_default_as_a_value():
    assert stage_settings()["save_every"] == -1 and stage_settings(save_every=60)["save_every"] == 60
    for bad in (dict(save_evry=60), dict(save_every="60"), dict(Stage=1)):  # a typo, a wrong type, not a setting
        with pytest.raises(ValueError, match="not a setting of the stage"):
            stage_settings(**bad)


# Each training script's config (the stage's settings and its own), with its defaults and with settings given: a hash of
# its keys and values, and its fingerprint without inputs (rerun.fingerprint), as they were when every script declared
# the stage's settings itself (main at 829fe42; the fingerprints also as at 7caa96c, before base_train's --attention
# default was named auto). Equal, a run made then is done, or resumed, by --rerun=auto now, never made again. A change
# to a default changes them, on purpose.
CONFIGS = [
    ("base_train", [], "a13789b23106b216", "328927c71fc53886"),
    ("mid_train", [], "96732f0b38dd2d51", "475f0b5a3e069c4f"),
    ("chat_sft", [], "6404e6ed79fb1cb4", "bf181865b5553875"),
    ("chat_rl", [], "4f7f2e88c219eb83", "a4bf8cd13a206e8e"),
    ("base_train", ["--save_every=7", "--model_tag=x", "--run=r", "--dry_run", "--depth=4"], "055996b534bd3647",
     "7077f62f036b19ae"),
    ("chat_rl", ["--save_every=7", "--rerun=auto", "--save_every_minutes=3", "--overwrite"], "c4283c41e74a675e",
     "a4bf8cd13a206e8e"),
]


@pytest.mark.parametrize("script, args, config_hash, made_from", CONFIGS)
def test_each_training_script_gives_its_stage_the_config_it_had(script, args, config_hash, made_from):
    name, config = given_to_stage(f"scripts.{script}", *args)
    assert name == {"base_train": "base", "mid_train": "mid", "chat_sft": "sft", "chat_rl": "rl"}[script]
    assert hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16] == config_hash, config
    assert fingerprint(name, config, {}) == made_from


def test_a_stage_is_made_from_what_its_script_reads_and_one_made_already_exits(trained_tokenizer, isolated_env,
                                                                               tmp_path, capsys):
    """
    What a stage reads, which its fingerprint hashes, is what each script named before Stage took it over: base_train
    the tokenizer and the corpus; the others the model they start from and the files of their settings.
    """
    config = stage_config(rerun="auto")
    base = Stage("base", config, model_tag="d1")
    assert base.made_from == fingerprint("base", config, dict(tokenizer=tokenizer_input(), corpus=corpus_input()))
    own = tmp_path / "own.jsonl"
    own.write_text('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]\n')
    mid = Stage("mid", stage_config(), source="base", source_step=3,
                files=dict(conversations=str(own), identity_file=""))
    assert mid.made_from == fingerprint("mid", stage_config(), dict(source=checkpoint_input("base", "", 3),
                                                           conversations=file_input(str(own)),
                                                           identity_file=file_input("")))
    # made already: its report section and its last checkpoint, from the same settings and inputs
    directory = isolated_env / "base_checkpoints" / "d1"
    directory.mkdir(parents=True)
    (directory / "meta_000004.json").write_text(json.dumps({"made_from": base.made_from}))
    get_report().log("Base model training", [{"Stopped early": False}], made_from=base.made_from)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        Stage("base", config, model_tag="d1")
    assert done.value.code == 0
    assert "Base model training: done at " in capsys.readouterr().out
    Stage("base", dict(config, overwrite=True), model_tag="d1")  # --overwrite: made again
    Stage("base", dict(config, rerun="no"), model_tag="d1")
    # a chat stage with --rerun=auto before its source model exists: not done, and no error about an empty
    # --model_tag; its loading says what is missing (run `python -m scripts.chat_sft` first)
    assert not Stage("rl", stage_config(rerun="auto"), source="sft")._rerun
