"""
Models out: scripts/export_model.py writes a directory that transformers loads with no custom code (same logits,
same greedy tokens, same token ids, same chat prompts as ours). Bad input is one line and leaves nothing behind.

One fp32 export of the session's tiny midtrained model (tiny_chat_base) is shared by the tests (`exported`).
"""

import json
import os
import runpy
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from nanochat.common import UserError

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi  there\n\tfriend"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "def f(x):\n    return x ** 2"}],
    [{"role": "user", "content": "Compute 12*7 ünïcode 🎉"},
     {"role": "assistant", "content": [{"type": "text", "text": "Let me check. "}, {"type": "python", "text": "12*7"},
                                       {"type": "python_output", "text": "84"}, {"type": "text", "text": "It is 84."}]},
     {"role": "user", "content": "And 3 x 3?"}, {"role": "assistant", "content": "9"}],
]
TEXTS = ["Hello world", "def f(x):\n    return x**2  # square\n", "  leading   and trailing   \n\n\n\t\t",
         "héllo wörld, 中文字符, Ελληνικά", "emoji 🎉🚀👍🏽 mixed", "digits 1234567890 3.14159 1e-10",
         "\r\n\r\nwindows\r\nlines", "'s 't 're 've 'm 'll 'd THEY'LL", "", " ", "x" * 300]


def run(module, *args, base, timeout=300):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), OMP_NUM_THREADS="1", NANOCHAT_DATASET="pydocs")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def run_inprocess(module, *args, monkeypatch):
    """Run a script in this process (no interpreter start-up): its UserError propagates to the test."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    runpy.run_module(module, run_name="__main__")


def one_line_error(result):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="session")
def exported(tiny_chat_base, tmp_path_factory):
    """The tiny midtrained model exported in fp32 (read-only)."""
    out = tmp_path_factory.mktemp("export") / "hf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(tiny_chat_base))
        run_inprocess("scripts.export_model", "--source=mid", f"--out={out}", "--dtype=float32", monkeypatch=mp)
    return out


@pytest.fixture(scope="session")
def ours(tiny_chat_base):
    """(model, tokenizer, meta) of the exported checkpoint, loaded by our code."""
    from nanochat.checkpoint_manager import load_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(tiny_chat_base))
        return load_model("mid", "cpu", phase="eval")


@pytest.fixture(scope="session")
def hf_model(exported):
    return transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(exported):
    return transformers.AutoTokenizer.from_pretrained(exported)


def max_logit_difference(model, hf, ids):
    with torch.no_grad():
        return (model(ids) - hf(ids).logits).abs().max().item()


# -----------------------------------------------------------------------------
# export


def test_export_matches_our_logits_and_greedy_tokens(ours, hf_model):
    model, tokenizer, _ = ours
    torch.manual_seed(0)
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, model.config.sequence_len))  # the full context
    ids[:, 0] = tokenizer.get_bos_token_id()
    assert max_logit_difference(model, hf_model, ids) <= 1e-4
    from nanochat.engine import Engine
    for prompt in (tokenizer.encode("The function", prepend="<|bos|>"),
                   tokenizer.render_for_completion({"messages": CONVERSATIONS[0]})):
        engine_tokens = [column[0] for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=24, temperature=0)]
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out[0, len(prompt):].tolist() == engine_tokens


def test_exported_tokenizer_gives_our_ids(ours, hf_tokenizer, pydocs_dir):
    import pyarrow.parquet as pq
    _, tokenizer, _ = ours
    shard = sorted(n for n in os.listdir(pydocs_dir) if n.startswith("shard_"))[-1]
    docs = pq.read_table(os.path.join(pydocs_dir, shard), columns=["text"]).column("text").to_pylist()[:200]
    for text in TEXTS + docs:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == tokenizer.encode(text, prepend="<|bos|>"), text[:80]  # <|bos|> first, as our prepend
        assert hf_tokenizer.decode(ids[1:]) == text
    for name, i in tokenizer.get_special_tokens().items():
        assert hf_tokenizer(name, add_special_tokens=False)["input_ids"] == [i]
        assert hf_tokenizer.decode([i]) == name == tokenizer.decode([i])


def test_chat_template_renders_our_prompts(ours, hf_tokenizer):
    _, tokenizer, _ = ours
    for messages in CONVERSATIONS:
        conversation = {"messages": messages}
        ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == tokenizer.render_for_completion(conversation)
        if messages[-1]["role"] == "assistant":
            ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            assert ids == tokenizer.render_conversation(conversation)[0]
    for bad in ([{"role": "assistant", "content": "first"}], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]):
        with pytest.raises(Exception, match="alternate"):  # as render_for_completion refuses them
            hf_tokenizer.apply_chat_template(bad, add_generation_prompt=True)


def test_export_files(exported, ours):
    model, tokenizer, _ = ours
    names = sorted(os.listdir(exported))
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                            "tokenizer_config.json", "chat_template.jinja", "README.md"])
    from safetensors.torch import load_file  # the reference reader agrees with our writer
    from nanochat.hf_format import weight_names
    tensors = load_file(exported / "model.safetensors")
    for ours_name, hf_name in weight_names(model.config.n_layer):
        assert torch.equal(tensors[hf_name], model.state_dict()[ours_name]), hf_name
    assert len(tensors) == len(model.state_dict())
    special = tokenizer.get_special_tokens()
    assert json.loads((exported / "generation_config.json").read_text())["eos_token_id"] == [special["<|assistant_end|>"], special["<|bos|>"]]
    card = (exported / "README.md").read_text()
    assert f"| {model.num_params():,} | 1 | 64 |" in card
    assert "10 steps x 256 tokens = 2,560 tokens" in card  # base and mid: 10 steps of 256 tokens each
    assert "not recorded (no report card" in card  # the tiny run evaluated nothing


def test_export_refusals(chat_base, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    error = one_line_error(run("scripts.export_model", "--source=mid", f"--out={out}", base=chat_base))
    assert "is not empty" in error and "--overwrite" in error
    assert os.listdir(out) == ["keep.txt"]
    with pytest.raises(UserError, match="--out=DIR is required"):
        run_inprocess("scripts.export_model", "--source=mid", monkeypatch=monkeypatch)
    with pytest.raises(UserError, match="chatsft_checkpoints"):
        run_inprocess("scripts.export_model", "--source=sft", f"--out={tmp_path / 'x'}", monkeypatch=monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nanochat_base", "out"]  # no --out, no temporary left
    # a setting the format cannot hold is named
    from nanochat.hf_format import hf_config
    model_config = dict(sequence_len=64, vocab_size=512, n_layer=1, n_head=1, n_kv_head=1, n_embd=64, window_pattern="SSSL")
    with pytest.raises(UserError, match="window_pattern='SSSL' has no equivalent"):
        hf_config(model_config, None, "float32")
    # --overwrite replaces the directory, in bf16 by default
    run_inprocess("scripts.export_model", "--source=mid", f"--out={out}", "--overwrite", monkeypatch=monkeypatch)
    assert "keep.txt" not in os.listdir(out) and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_mlx_layout_keeps_our_names(chat_base, tmp_path, monkeypatch):
    from nanochat.model_files import load_safetensors
    run_inprocess("scripts.export_model", "--source=mid", f"--out={tmp_path / 'mlx'}", "--layout=mlx", monkeypatch=monkeypatch)
    assert "transformer.wte.weight" in load_safetensors(tmp_path / "mlx" / "model.safetensors")
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["rope_theta"] == 10000.0
