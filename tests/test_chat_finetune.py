"""
The chat finetuning stages: scripts/chat_sft.py and scripts/chat_rl.py end to end on a tiny midtrained model.

On offline data; SFT's exact resume and its steps without targets (no update), and the RL update on hand-computed
numbers and on a trivial task where it must raise the reward.
"""

import json

import pytest
import torch

from helpers import check_steps_without_targets, run_script, run_signalled, same_state, ToyModel
from nanochat.losses import count_step_targets, group_advantages, policy_gradient_loss

SFT = ["-m", "scripts.chat_sft", "--mixture=offline", "--max_seq_len=128", "--device_batch_size=2",
       "--examples_per_step=4", "--eval_tokens=1024", "--eval_metrics_max_problems=8"]
RL = ["-m", "scripts.chat_rl", "--source=mid", "--mixture=offline", "--prompts_per_step=2", "--num_samples=4",
      "--max_new_tokens=16", "--eval_examples=4", "--device_batch_size=4", "--temperature=1.0"]


@pytest.fixture
def chat_base(tiny_model):
    """This test's copy of the session's tiny midtrained model (depth 1, context 64), with corpus and tokenizer."""
    return tiny_model("mid")


@pytest.fixture
def rl_base(tiny_model):
    """This test's copy of the session's tiny midtrained model of context 512: room for RL's prompts and answers."""
    return tiny_model("mid512")


def step_losses(checkpoint_dir, key="step_loss"):
    rows = [json.loads(line) for line in (checkpoint_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_sft_trains_evaluates_and_resumes_exactly(chat_base):
    ckpt = chat_base / "chatsft_checkpoints" / "d1"
    first = run_script(*SFT, "--num_iterations=6", "--save_every=3", "--eval_every=3")
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout
    assert "Examples per step 4 => gradient accumulation steps: 2" in out
    assert "validation bpb" in out and "PydocsMC accuracy" in out and "(the mid model, before SFT)" in out
    section = (chat_base / "report" / "chat-sft.md").read_text()
    assert "- Validation bpb before SFT: " in section and "- PydocsMC accuracy: " in section
    full_losses = step_losses(ckpt)
    full_weights = torch.load(ckpt / "model_000006.pt")
    assert len(full_losses) == 6
    for f in ckpt.glob("*000006*"):
        f.unlink()
    resumed = run_script(*SFT, "--num_iterations=6", "--resume_from_step=3", "--eval_every=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert step_losses(ckpt) == pytest.approx(full_losses, rel=1e-6)
    for k, v in torch.load(ckpt / "model_000006.pt").items():
        assert torch.allclose(v, full_weights[k], rtol=1e-6, atol=0), k
    # the SFT model loads where chat models are loaded
    from nanochat.checkpoint_manager import load_model
    model, tokenizer, meta = load_model("sft", "cpu", phase="eval")
    assert meta["step"] == 6 and meta["parent"]["source"] == "mid"


@pytest.mark.slow
def test_sft_steps_without_targets_change_nothing(chat_base):
    """
    At --max_seq_len=32 with one conversation per step most offline conversations are cut before their first
    answer: such a step (0 targets) updates nothing (the weights and every optimizer state stay bit for bit, also
    after steps that learned, where AdamW's momentum would move them), its loss stays out of the EMA and the
    metrics, the run counts it; a resume after it continues exactly.
    """
    ckpt = chat_base / "chatsft_checkpoints" / "d1"
    args = [a for a in SFT if not a.startswith(("--max_seq_len", "--device_batch_size", "--examples_per_step"))]
    args += ["--max_seq_len=32", "--device_batch_size=1", "--examples_per_step=1", "--num_iterations=12",
             "--eval_every=-1", "--eval_metrics_every=-1"]
    result = run_script(*args, "--save_every=1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows, skipped, learned = check_steps_without_targets(result, ckpt, 12)
    section = (chat_base / "report" / "chat-sft.md").read_text()
    assert f"- Steps without targets (skipped): {len(skipped)}\n" in section
    # a resume from the first step that learned: the count of the EMA's updates comes back too
    resume_at = learned[0]["step"]
    final_weights = torch.load(ckpt / "model_000012.pt")
    for f in ckpt.glob("*_0000*"):
        if int(f.name.split("_")[1].split(".")[0]) > resume_at:
            f.unlink()
    resumed = run_script(*args, f"--resume_from_step={resume_at}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "step_loss", "targets", "grad_norm")
    assert [[r[k] for k in keys] for r in resumed_rows if "targets" in r] == [[r[k] for k in keys] for r in rows]
    assert same_state(torch.load(ckpt / "model_000012.pt"), final_weights)
    assert f"Steps without targets (skipped): {len(skipped)} of 12," in resumed.stdout


@pytest.mark.slow
def test_sft_batch_arithmetic_error_is_one_line(chat_base):
    result = run_script(*[a for a in SFT if not a.startswith("--examples_per_step")], "--examples_per_step=5",
                        "--num_iterations=2")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "examples_per_step 5 is not a multiple of device_batch_size x world_size = 2 x 1 = 2" in lines[0]


def test_advantages_and_policy_gradient_loss_by_hand():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]).tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 1.0, 1.0]).tolist() == [0.0, 0.0, 0.0]  # all right: nothing to learn
    # ToyModel: loss of target t is w * t, so log p(t) = -w * t (w = 1). Two answers: tokens 2, 3 (advantage +0.5)
    # and token 4 (advantage -0.5); -1 marks tokens that were not sampled (prompt, forced tool output).
    x = torch.zeros(2, 3, dtype=torch.long)
    y = torch.tensor([[-1, 2, 3], [-1, 4, -1]])
    advantages = torch.tensor([0.5, -0.5])
    _, tokens = count_step_targets([(x, y)], 0, 1)
    assert tokens == 3
    model = ToyModel()
    loss, logp_sum = policy_gradient_loss(model, x, y, advantages, tokens, 1)
    # -(0.5 * (-2 - 3) + (-0.5) * (-4)) / 3 = -(-2.5 + 2) / 3 = 0.5 / 3
    assert loss.item() == pytest.approx(0.5 / 3) and logp_sum.item() == pytest.approx(-9.0)
    loss.backward()
    assert model.w.grad.item() == pytest.approx(0.5 / 3)  # d/dw of (0.5 * 5 - 0.5 * 4) w / 3
    # all advantages 0 (every answer got the same reward): exactly zero gradient, so chat_rl skips such micro-batches
    model = ToyModel()
    loss, _ = policy_gradient_loss(model, x, y, group_advantages([1.0, 1.0]), tokens, 1)
    loss.backward()
    assert model.w.grad.item() == 0.0


def test_a_few_policy_gradient_steps_raise_the_reward_on_a_trivial_task(trained_tokenizer):
    """Reward 1 when the first sampled token has an even id: a random model gets ~0.5; RL must push it up."""
    from nanochat.engine import Engine
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import get_tokenizer
    torch.manual_seed(0)
    tokenizer = get_tokenizer()
    model = GPT(GPTConfig(sequence_len=16, vocab_size=tokenizer.get_vocab_size(), n_layer=1, n_head=1, n_kv_head=1,
                          n_embd=32))
    model.init_weights()
    optimizers = model.setup_optimizers(unembedding_lr=0.01, embedding_lr=0.01, matrix_lr=0.01)
    engine = Engine(model, tokenizer)
    bos = tokenizer.get_bos_token_id()
    rewards_per_step = []
    for step in range(12):
        columns = list(engine.generate([bos], num_samples=32, max_tokens=1, temperature=1.0, seed=step))
        first = columns[0][0]
        rewards = [float(t % 2 == 0) for t in first]
        rewards_per_step.append(sum(rewards) / len(rewards))
        x = torch.full((32, 1), bos, dtype=torch.long)
        y = torch.tensor(first, dtype=torch.long).view(32, 1)
        _, tokens = count_step_targets([(x, y)], 0, 1)
        loss, _ = policy_gradient_loss(model, x, y, group_advantages(rewards), tokens, 1)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
    early = sum(rewards_per_step[:2]) / 2
    late = sum(rewards_per_step[-3:]) / 3
    assert 0.25 < early < 0.75 and late > early + 0.2, rewards_per_step  # starts near chance, ends well above


@pytest.mark.slow
def test_rl_resume_equals_the_uninterrupted_run(rl_base):
    """
    The problems and seeds of a step depend only on the step: a resumed RL run samples, rewards and trains
    exactly as the uninterrupted one (same answers, rewards and weights). The tiny model earns no reward, so its
    weights stay put; the optimizer state's part of a resume is the stage protocol's, proven by the other stages.
    """
    ckpt = rl_base / "chatrl_checkpoints" / "d1"
    # room to end some answers, and a temperature at which a tiny model ends some (at 1.0 the one trained with dense
    # attention ran every answer to 64 tokens, so that the steps' answers showed no difference in length)
    rl = [a for a in RL if not a.startswith(("--max_new_tokens", "--temperature"))]
    rl += ["--max_new_tokens=64", "--temperature=1.5"]
    full = run_script(*rl, "--num_iterations=4", "--save_every=2", "--eval_every=-1")
    assert full.returncode == 0, full.stderr[-3000:]
    full_rewards = step_losses(ckpt, "reward")
    full_weights = torch.load(ckpt / "model_000004.pt")
    full_lengths = step_losses(ckpt, "answer_length")
    assert len(full_rewards) == 4 and len(set(full_lengths)) > 1, full_lengths  # the steps sampled different answers
    for f in ckpt.glob("*000004*"):
        f.unlink()
    resumed = run_script(*rl, "--num_iterations=4", "--resume_from_step=2", "--save_every=2", "--eval_every=-1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step 2" in resumed.stdout
    assert step_losses(ckpt, "reward") == full_rewards and step_losses(ckpt, "answer_length") == full_lengths
    for k, v in torch.load(ckpt / "model_000004.pt").items():
        assert torch.allclose(v, full_weights[k], rtol=1e-6, atol=0), k


@pytest.mark.slow
def test_rl_stops_within_seconds_in_pass_at_k_and_in_sampling(rl_base):
    """
    A SIGTERM in the first pass@k (the 270 test problems x 16 answers: minutes) stops it at once; the step that
    follows drops its sampling at its first token; the stage saves step 0 and exits 75, the last pass@k also cut short.
    """
    args = [a for a in RL if not a.startswith(("--num_samples", "--eval_examples"))]
    # the SIGTERM from inside the write of the pass@k line (helpers.run_signalled: deterministic)
    result, seconds = run_signalled("pass@k: 270 test problems x 16 answers", "SIGTERM", *args, "--num_samples=16",
                                    "--eval_examples=500", "--num_iterations=3")
    out = result.stdout + result.stderr
    assert result.returncode == 75 and seconds < 20 and "Traceback" not in out, out[-3000:]
    assert "Step 00000 | pass@k stopped: a stop was requested" in out
    assert "step 00001/00003 | stopped while sampling" in out and "mean reward" not in out
    assert "--resume_from_step=0" in out
    assert (rl_base / "chatrl_checkpoints" / "d1" / "meta_000000.json").exists()


@pytest.mark.slow
def test_sft_stops_within_seconds_in_its_evaluations(chat_base):
    """
    A Ctrl-C in SFT's first validation (eval_tokens: hours of it) stops it at once; one training step finishes and
    is saved; the final evaluations stop at once too; exit 75.
    """
    args = [a for a in SFT if not a.startswith("--eval_tokens")]
    # Ctrl-C (SIGINT) from inside the write of the first batch's line, just before the validation
    result, seconds = run_signalled("x, y = next(train_loader)", "SIGINT", *args, "--eval_tokens=100000000",
                                    "--num_iterations=5")
    out = result.stdout + result.stderr
    assert result.returncode == 75 and seconds < 30 and "Traceback" not in out, out[-3000:]
    assert "Step 00000 | evaluations stopped: a stop was requested" in out
    assert "step 00001 (" in out and "step 00002 (" not in out and "Step 00001 | evaluations stopped" in out
    assert (chat_base / "chatsft_checkpoints" / "d1" / "meta_000001.json").exists()


@pytest.mark.slow
def test_chat_rl_end_to_end_on_two_ranks(rl_base):
    result = run_script(*RL, "--num_iterations=3", "--save_every=-1", "--eval_every=-1", nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Problems / step: 2 (1 per rank) x 4 sampled answers = 8 answers" in out
    assert "step 00003/00003 | mean reward:" in out and "pass@4:" in out
    # the tiny model earns no reward, so each rank skips every micro-batch (advantages all 0) and steps on zero
    # gradients: every collective of the optimizers still has its gradients
    assert "answers learned from: 0/8" in out
    ckpt = rl_base / "chatrl_checkpoints" / "d1"
    meta = json.loads((ckpt / "meta_000003.json").read_text())
    assert meta["world_size"] == 2 and set(meta["pass_at_k"]) == {"1", "2", "3", "4"}
    assert (ckpt / "optim_000003_rank1.pt").exists()
    rewards = step_losses(ckpt, "reward")
    assert len(rewards) == 3 and all(0.0 <= r <= 1.0 for r in rewards)
    section = (rl_base / "report" / "chat-rl.md").read_text()
    assert "- pass@1: " in section and "- pass@1 before RL: " in section
