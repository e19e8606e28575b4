"""
Models in and out: export_model's directories in transformers, import_model's three kinds of input.

scripts/export_model.py writes a directory that transformers loads with no custom code (same logits, same greedy
tokens, same token ids, same chat prompts as ours), scripts/import_model.py reads such a directory, one written by
transformers' save_pretrained and a checkpoint of karpathy/nanochat's layout, and an imported model keeps its own
tokenizer. Bad input is one line and leaves nothing behind.

One fp32 export of the session's tiny midtrained model (conftest's tiny_models) is shared by the tests (`exported`).
The karpathy/nanochat checkpoint of tests/fixtures/reference_nanochat/ was written by that code itself, with what its
own loader gives for it (make_fixture.py there): the import must give the same token ids and logits.
"""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch._dynamo

from helpers import one_line_error, run_in_process, run_script
from nanochat.attention_kernels import KERNELS
from nanochat.files import file_sha256
from nanochat.output import UserError

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
         "héllo wörld, 中文字符, Ελληνικά", "संकेत नमस्ते, ยอมรับข้อตกลง, 日本語のテキスト", "emoji 🎉🚀👍🏽 mixed",
         "digits 1234567890 3.14159 1e-10",
         "\r\n\r\nwindows\r\nlines", "'s 't 're 've 'm 'll 'd THEY'LL", "", " ", "x" * 300]


def run(module, *args, base, timeout=300):
    return run_script("-m", module, *args, env={"NANOCHAT_BASE_DIR": base, "NANOCHAT_DATASET": "pydocs"},
                      timeout=timeout)


@pytest.fixture
def chat_base(tiny_model):
    """This test's copy of the session's tiny midtrained model, as its NANOCHAT_BASE_DIR."""
    return tiny_model("mid2025")


@pytest.fixture(scope="session")
def exported(tiny_models, tmp_path_factory):
    """The tiny midtrained model exported in fp32 (read-only)."""
    out = tmp_path_factory.mktemp("export") / "hf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(tiny_models("mid2025")))
        run_in_process("scripts.export_model", "--source=mid", f"--out={out}", "--dtype=float32", monkeypatch=mp)
    return out


@pytest.fixture(scope="session")
def ours(tiny_models):
    """(model, tokenizer, meta) of the exported checkpoint, loaded by our code."""
    from nanochat.checkpoint_manager import load_model
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(tiny_models("mid2025")))
        return load_model("mid", "cpu", phase="eval")


@pytest.fixture(scope="session")
def hf_tokenizer(exported):
    return transformers.AutoTokenizer.from_pretrained(exported)


def max_logit_difference(model, hf, ids):
    with torch.no_grad():
        return (model(ids) - hf(ids).logits).abs().max().item()


# -----------------------------------------------------------------------------
# export


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_export_matches_our_logits_and_greedy_tokens(ours, exported, attention):
    """
    transformers' own NanoChat, with its attention implementations, gives the fp32 logits of our model run with the
    kernel of the same arithmetic (GPT.attention_kernel) to the bit, and our default SDPA's within 1e-5 (eager rounds
    otherwise than that fused kernel). Its flex_attention: tests/test_export_remote.py, the plain layout's "rope".
    """
    model, tokenizer, _ = ours
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                                 attn_implementation=attention).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, model.config.sequence_len))  # the full context
    ids[:, 0] = tokenizer.get_bos_token_id()
    assert max_logit_difference(model, hf_model, ids) <= 1e-5
    model.attention_kernel = KERNELS[attention]
    try:
        assert max_logit_difference(model, hf_model, ids) == 0.0
    finally:
        model.attention_kernel = KERNELS["sdpa"]
    from nanochat.engine import Engine
    for prompt in (tokenizer.encode("The function", prepend="<|bos|>"),
                   tokenizer.render_for_completion({"messages": CONVERSATIONS[0]})):
        engine_tokens = [column[0]
                         for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=24, temperature=0)]
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
    # content as a list of text parts, as OpenAI's API allows and vLLM's server passes every message
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CONVERSATIONS[1][:2]]
    assert (hf_tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=True, return_dict=False)
            == tokenizer.render_for_completion({"messages": CONVERSATIONS[1][:2]}))
    for bad in ([{"role": "assistant", "content": "first"}],
                [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]):
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
    assert (json.loads((exported / "generation_config.json").read_text())["eos_token_id"]
            == [special["<|assistant_end|>"], special["<|bos|>"]])
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
        run_in_process("scripts.export_model", "--source=mid", monkeypatch=monkeypatch)
    with pytest.raises(UserError, match="chatsft_checkpoints"):
        run_in_process("scripts.export_model", "--source=sft", f"--out={tmp_path / 'x'}", monkeypatch=monkeypatch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nanochat_base", "out"]  # no --out, no temporary left
    # a setting the format cannot hold is named
    from nanochat.hf_format import hf_config
    model_config = dict(sequence_len=64, vocab_size=512, n_layer=1, n_head=1, n_kv_head=1, n_embd=64,
                        window_pattern="SSSL")
    with pytest.raises(UserError, match="window_pattern='SSSL' has no equivalent"):
        hf_config(model_config, None, "float32")
    # --overwrite replaces the directory, in bf16 by default; the model card shows the report card's scores
    from nanochat.report import get_report
    from tasks.registry import report_card_labels  # the labels chat_eval gives its section
    get_report().log(section="Chat evaluation mid", data=[{"model": "mid d1 step 10"}, {"ARC-Easy": 0.3125}],
                     card_labels=dict(report_card_labels()))
    run_in_process("scripts.export_model", "--source=mid", f"--out={out}", "--overwrite", monkeypatch=monkeypatch)
    assert "keep.txt" not in os.listdir(out) and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    assert "| ARC-E | - | 0.3125 | - | - |" in card and "- chat-evaluation-mid: mid d1 step 10" in card


def test_mlx_layout_keeps_our_names(chat_base, tmp_path, monkeypatch):
    from nanochat.hf_format import load_safetensors
    run_in_process("scripts.export_model", "--source=mid", f"--out={tmp_path / 'mlx'}", "--layout=mlx",
                   monkeypatch=monkeypatch)
    assert "transformer.wte.weight" in load_safetensors(tmp_path / "mlx" / "model.safetensors")
    assert json.loads((tmp_path / "mlx" / "config.json").read_text())["rope_theta"] == 10000.0


# -----------------------------------------------------------------------------
# import


def test_export_import_round_trip(exported, ours, isolated_env, monkeypatch):
    """Into an empty base dir (no tokenizer there): the model comes back with its weights and its own tokenizer."""
    from nanochat.checkpoint_manager import load_model
    model, tokenizer, _ = ours
    run_in_process("scripts.import_model", f"--path={exported}", "--source=sft", "--model_tag=back",
                   monkeypatch=monkeypatch)
    back, back_tokenizer, meta = load_model("sft", "cpu", phase="eval", model_tag="back")
    assert back_tokenizer.fingerprint() == tokenizer.fingerprint() == meta["tokenizer"]["fingerprint"]
    assert back_tokenizer.directory == str(isolated_env / "chatsft_checkpoints" / "back" / "tokenizer")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert meta["imported_from"]["format"] == "Hugging Face NanoChat"
    with pytest.raises(UserError, match="already holds a model"):
        run_in_process("scripts.import_model", f"--path={exported}", "--source=sft", "--model_tag=back",
                       monkeypatch=monkeypatch)


def test_import_save_pretrained_directory(exported, tmp_path, isolated_env, monkeypatch):
    from nanochat.checkpoint_manager import load_model
    vocab_size = json.loads((exported / "config.json").read_text())["vocab_size"]
    config = transformers.NanoChatConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=32,
                                         bos_token_id=vocab_size - 9, eos_token_id=vocab_size - 5, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.NanoChatForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # HF zero-inits nothing we need; make every weight matter
            p.normal_(0, 0.3)
    directory = tmp_path / "saved"
    hf.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(exported / name, directory / name)
    run_in_process("scripts.import_model", f"--path={directory}", "--source=base", monkeypatch=monkeypatch)
    model, _, _ = load_model("base", "cpu", phase="eval", model_tag="saved")
    ids = torch.randint(0, vocab_size, (2, 32))
    assert max_logit_difference(model, hf, ids) <= 1e-4  # HF's default rms_norm_eps 1e-6 vs our 1.2e-7: within it


def reference_checkpoint(directory, tokenizer, step=650):
    """
    A checkpoint as karpathy/nanochat's code writes it (see nanochat/reference_format.py), built here from the
    format: compiled-model key prefixes, vocab padded to a multiple of 64, bf16 embedding, a pickled tiktoken
    Encoding. Returns our GPT holding the same (unpadded) weights.
    """
    import tiktoken
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.hf_format import MODEL_CONFIG_KEYS
    vocab_size = tokenizer.get_vocab_size()
    config = GPTConfig(sequence_len=32, vocab_size=vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    torch.manual_seed(1)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        model.transformer.wte.weight.copy_(model.transformer.wte.weight.bfloat16())  # what bf16 storage keeps
    padded = (vocab_size + 63) // 64 * 64
    state = {}
    for name, tensor in model.state_dict().items():
        if name in ("transformer.wte.weight", "lm_head.weight"):
            tensor = torch.cat([tensor, torch.zeros(padded - vocab_size, tensor.size(1))])
        state["_orig_mod." + name] = tensor.bfloat16() if name == "transformer.wte.weight" else tensor
    os.makedirs(directory)
    torch.save(state, os.path.join(directory, f"model_{step:06d}.pt"))
    with open(os.path.join(directory, f"meta_{step:06d}.json"), "w") as f:
        # that code's fields (2025)
        model_config = {k: v for k, v in config.to_dict().items() if k in MODEL_CONFIG_KEYS}
        json.dump({"step": step, "model_config": model_config, "user_config": {"device_batch_size": 4}}, f)
    enc = tiktoken.Encoding(name="rustbpe", pat_str=tokenizer.pattern, mergeable_ranks=tokenizer.mergeable_ranks,
                            special_tokens=tokenizer.get_special_tokens())
    with open(os.path.join(directory, "tokenizer.pkl"), "wb") as f:
        pickle.dump(enc, f)
    torch.save(tokenizer.compute_token_bytes(), os.path.join(directory, "token_bytes.pt"))
    return model


def test_import_reference_checkpoint(ours, tmp_path, isolated_env, monkeypatch):
    from nanochat.checkpoint_manager import load_model
    _, tokenizer, _ = ours
    reference = reference_checkpoint(tmp_path / "d2", tokenizer)
    run_in_process("scripts.import_model", f"--path={tmp_path / 'd2'}", "--source=sft", monkeypatch=monkeypatch)
    model, imported_tokenizer, meta = load_model("sft", "cpu", phase="eval", model_tag="d2")
    assert meta["step"] == 650 and meta["user_config"] == {"device_batch_size": 4}
    assert imported_tokenizer.fingerprint() == tokenizer.fingerprint()
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, 32))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))  # the same weights, once the padding rows are cut


def test_import_refusals(ours, tmp_path, isolated_env, monkeypatch):
    _, tokenizer, _ = ours
    empty = tmp_path / "empty"
    empty.mkdir()
    error = one_line_error(run("scripts.import_model", f"--path={empty}", "--source=sft", base=isolated_env))
    assert "neither a Hugging Face NanoChat directory" in error
    reference_checkpoint(tmp_path / "ref", tokenizer)
    os.remove(tmp_path / "ref" / "tokenizer.pkl")
    with pytest.raises(UserError, match="no tokenizer.pkl for the checkpoint"):
        run_in_process("scripts.import_model", f"--path={tmp_path / 'ref'}", "--source=sft", monkeypatch=monkeypatch)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (tmp_path / "ref" / "tokenizer.pkl").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UserError, match=r"asks to load posix.system: .* refused"):
        run_in_process("scripts.import_model", f"--path={tmp_path / 'ref'}", "--source=sft", monkeypatch=monkeypatch)
    os.remove(tmp_path / "ref" / "meta_000650.json")
    with pytest.raises(UserError, match="not a complete karpathy/nanochat checkpoint"):
        run_in_process("scripts.import_model", f"--path={tmp_path / 'ref'}", "--source=sft", monkeypatch=monkeypatch)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "nanochat", "vocab_size": 521, "hidden_size": 64,
                                                    "intermediate_size": 256, "num_hidden_layers": 1,
                                                    "num_attention_heads": 1}))
    with pytest.raises(UserError, match="has config.json but no model.safetensors"):
        run_in_process("scripts.import_model", f"--path={hf_dir}", "--source=sft", monkeypatch=monkeypatch)
    (hf_dir / "model.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(UserError, match="has no tokenizer.json"):
        run_in_process("scripts.import_model", f"--path={hf_dir}", "--source=sft", monkeypatch=monkeypatch)
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "nanochat", "hidden_act": "gelu", "vocab_size": 521,
                                                    "hidden_size": 64, "num_hidden_layers": 1,
                                                    "num_attention_heads": 1}))
    with pytest.raises(UserError, match="hidden_act='gelu'"):
        run_in_process("scripts.import_model", f"--path={hf_dir}", "--source=sft", monkeypatch=monkeypatch)
    assert not (isolated_env / "chatsft_checkpoints").exists() or not os.listdir(isolated_env / "chatsft_checkpoints")


# -----------------------------------------------------------------------------
# a checkpoint written by karpathy/nanochat's own code

REFERENCE_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "reference_nanochat")


@pytest.fixture(scope="module")
def reference_outputs():
    """What karpathy/nanochat's loader and tokenizer gave for the fixture's files (make_fixture.py recorded it)."""
    with open(os.path.join(REFERENCE_FIXTURE, "reference_outputs.json"), encoding="utf-8") as f:
        outputs = json.load(f)
    for name, digest in outputs["files"].items():  # recorded from these very files
        assert file_sha256(os.path.join(REFERENCE_FIXTURE, "d1", name)) == digest, name
    return outputs


@pytest.fixture
def reference_dir(tmp_path):
    """This test's copy of the checkpoint karpathy/nanochat's code wrote."""
    return shutil.copytree(os.path.join(REFERENCE_FIXTURE, "d1"), tmp_path / "d1")


def reference_logit_difference(model, outputs):
    """The largest |our logit - its logit| over what was recorded: vocab columns, each position's max and logsumexp."""
    worst = 0.0
    for recorded in outputs["logits"]:
        with torch.no_grad():
            logits = model(torch.tensor([recorded["ids"]]))[0]
        for ours, its in ((logits[:, outputs["logit_columns"]], recorded["columns"]),
                          (logits.max(-1).values, recorded["max"]), (logits.logsumexp(-1), recorded["logsumexp"])):
            worst = max(worst, (ours - torch.tensor(its)).abs().max().item())
    return worst


def test_import_checkpoint_written_by_reference_code(reference_outputs, reference_dir, monkeypatch):
    from nanochat.checkpoint_manager import load_model
    # 400 rows padded to 448
    assert torch.load(reference_dir / "model_000020.pt", weights_only=True)["lm_head.weight"].size(0) == 448
    run_in_process("scripts.import_model", f"--path={reference_dir}", "--source=base", "--model_tag=ref",
                  monkeypatch=monkeypatch)
    model, tokenizer, meta = load_model("base", "cpu", phase="eval", model_tag="ref")  # fp32 weights, no autocast: fp32
    assert meta["imported_from"]["step"] == reference_outputs["step"] == 20
    assert meta["model_config"] == reference_outputs["model_config"]
    assert tokenizer.get_special_tokens() == reference_outputs["special_tokens"]
    for text, ids in zip(reference_outputs["texts"], reference_outputs["ids"]):
        assert tokenizer.encode(text, prepend="<|bos|>") == ids, text
    conversation = reference_outputs["conversation"]
    assert list(tokenizer.render_conversation(conversation)) == reference_outputs["conversation_ids_mask"]
    assert tokenizer.render_for_completion(conversation) == reference_outputs["completion_ids"]
    # Its rotary tables are rounded to bf16 even in fp32 (_precompute_rotary_embeddings), ours stay fp32: measured
    # 7.7e-4 at most on these logits (of size up to 6.5). With our tables rounded the same way: 0.0 measured here
    # (1e-5 leaves room for another CPU's float rounding), so that is the only difference.
    assert reference_logit_difference(model, reference_outputs) <= 1.5e-3
    model.cos = model.cos.bfloat16().float()
    model.sin = model.sin.bfloat16().float()
    assert reference_logit_difference(model, reference_outputs) <= 1e-5


def test_reference_token_bytes_rule(reference_dir, monkeypatch):
    """
    Its tok_train counts a token's bytes decoded to text (a partial UTF-8 character counts as U+FFFD's 3 bytes),
    ours the raw bytes: both belong to its tokenizer.pkl; a token_bytes.pt of another tokenizer is still refused.
    """
    from nanochat.reference_format import decoded_token_bytes, read_tokenizer_pkl
    tokenizer = read_tokenizer_pkl(reference_dir / "tokenizer.pkl")
    written = torch.load(reference_dir / "token_bytes.pt", weights_only=True)
    assert torch.equal(decoded_token_bytes(tokenizer), written)
    differ = (written != tokenizer.compute_token_bytes()).nonzero().flatten().tolist()
    # every byte >= 0x80, and merges that cut a character
    assert differ[:128] == list(range(128, 256)) and len(differ) > 128
    changed = written.clone()
    changed[300] += 1
    for other in (changed, written[:-1]):  # one entry changed; a tokenizer of another vocab
        torch.save(other, reference_dir / "token_bytes.pt")
        with pytest.raises(UserError, match=r"token_bytes.pt does not match .*/tokenizer.pkl: "
                                            r"files of two different tokenizers"):
            run_in_process("scripts.import_model", f"--path={reference_dir}", "--source=base", monkeypatch=monkeypatch)
    torch.save({"not": "a tensor"}, reference_dir / "token_bytes.pt")
    with pytest.raises(UserError, match=r"token_bytes.pt holds dict, not a tensor of bytes per token"):
        run_in_process("scripts.import_model", f"--path={reference_dir}", "--source=base", monkeypatch=monkeypatch)
    # ours, as our tests' checkpoints have it
    torch.save(tokenizer.compute_token_bytes(), reference_dir / "token_bytes.pt")
    run_in_process("scripts.import_model", f"--path={reference_dir}", "--source=base", monkeypatch=monkeypatch)


# -----------------------------------------------------------------------------
# finetuning an imported model


def test_finetune_an_imported_model_then_export(exported, chat_base, tmp_path, monkeypatch):
    """
    An imported model with no tokenizer in the base dir: SFT trains it with its own tokenizer, the SFT checkpoint
    carries it, and the export of the result matches the SFT model.
    """
    shutil.rmtree(chat_base / "tokenizer")
    run_in_process("scripts.import_model", f"--path={exported}", "--source=mid", "--model_tag=imported",
                   monkeypatch=monkeypatch)
    for args in (["scripts.chat_sft", "--model_tag=imported", "--mixture=offline", "--max_seq_len=128",
                  "--device_batch_size=2", "--examples_per_step=4", "--num_iterations=2", "--eval_every=-1",
                  "--eval_tokens=512", "--eval_metrics_max_problems=4"],
                 ["scripts.export_model", "--source=sft", "--model_tag=imported", f"--out={tmp_path / 'out'}",
                  "--dtype=float32"]):
        result = run(*args, base=chat_base)
        assert result.returncode == 0, f"{args[0]}: {result.stderr[-2000:]}"
    from nanochat.checkpoint_manager import load_model
    model, tokenizer, _ = load_model("sft", "cpu", phase="eval", model_tag="imported")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert max_logit_difference(model, hf, torch.randint(0, tokenizer.get_vocab_size(), (1, 64))) <= 1e-4
