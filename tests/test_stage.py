"""
What nanochat/stage.py checks, in-process and fast: a non-finite loss or weights, a resumed run's settings. The
end-to-end resumes of each stage run the scripts (test_base_train, test_training_core, test_chat_finetune).
"""

import pytest
import torch

from nanochat.common import UserError
from nanochat.stage import Stage, check_stage_settings
from nanochat.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(small_tokenizer_dir):
    return Tokenizer.from_directory(str(small_tokenizer_dir))


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
