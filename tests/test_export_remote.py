"""
Exporting models with the 2026 recipe's parts (issue 24). rope_base alone fits transformers' own NanoChat (the plain
layout); qk_scale, layer scalars and value embeddings do not, so export_model's default picks the remote-code layout:
our modeling file beside the weights, loaded with trust_remote_code=True, which must compute our logits and our greedy
tokens (with its KV cache), and import back as the same weights. `--layout=hf` (or mlx) on such a model is refused.

The checkpoints are untrained (init_weights, then random values where init puts zeros: the output projections and
the head), saved as a training stage saves them, with the session's small tokenizer.
"""

import json
import shutil

import pytest
import torch
import torch._dynamo

from helpers import one_line_error, run_in_process, run_script, save_random_model
from nanochat.attention_kernels import KERNELS
from nanochat.checkpoint_manager import load_model
from nanochat.engine import Engine, generate_naive
from nanochat.gpt import GPTConfig
from nanochat.hf_format import MODELING_FILE, modeling_source
from nanochat.output import UserError
from nanochat.tokenizer import get_tokenizer

transformers = pytest.importorskip("transformers")

MODELS = {  # model_tag: (GPTConfig parts, init recipe)
    "r26": (dict(rope_base=100000.0, qk_scale=1.2, layer_scalars=True, value_embeds=True), "2026"),
    # sliding windows (layers 0 and 1 see 128 earlier tokens, layer 2 all), at the context of 160 where they bind
    "win": (dict(window_pattern="S"), "2025"),
    "rope": (dict(rope_base=100000.0), "2025"),
}


@pytest.fixture(scope="session")
def recipe_base(small_tokenizer_dir, tmp_path_factory):
    """
    A read-only base dir: the small tokenizer and base checkpoints of MODELS (3 layers, GQA 4:2, width 32, context
    160). Our flex kernel at these shapes (q (2, 4, 160, 8)) is tests/test_attention.py's too: one compile serves
    both (torch.compile's cache on disk), where another shape is a compile of its own.
    """
    base = tmp_path_factory.mktemp("recipe_base")
    shutil.copytree(small_tokenizer_dir, base / "tokenizer")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base))
        tokenizer = get_tokenizer()
        for tag, (parts, recipe) in MODELS.items():
            config = GPTConfig(**dict(dict(sequence_len=160, vocab_size=tokenizer.get_vocab_size(), n_layer=3,
                                           n_head=4, n_kv_head=2, n_embd=32), **parts))
            save_random_model(config, tokenizer, tag, recipe)
    return base


@pytest.fixture(scope="session")
def exports(recipe_base, tmp_path_factory):
    """export(tag): the fp32 export of MODELS[tag] with the default layout (made once), and load(tag): ours of it."""
    out = tmp_path_factory.mktemp("exports")
    done = {}

    def export(tag):
        if tag not in done:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("NANOCHAT_BASE_DIR", str(recipe_base))
                run_in_process("scripts.export_model", "--source=base", f"--model_tag={tag}", f"--out={out / tag}",
                              "--dtype=float32", monkeypatch=mp)
            done[tag] = out / tag
        return done[tag]
    return export


def ours(recipe_base, tag):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(recipe_base))
        return load_model("base", "cpu", phase="eval", model_tag=tag)


@pytest.fixture(scope="session")
def remote_model(exports, tmp_path_factory):
    """transformers' model of the r26 export, from our modeling file (trust_remote_code), in fp32."""
    import transformers.dynamic_module_utils as modules
    with pytest.MonkeyPatch.context() as mp:  # where transformers copies remote code: not the user's ~/.cache
        mp.setattr(modules, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules")))
        return transformers.AutoModelForCausalLM.from_pretrained(exports("r26"), trust_remote_code=True,
                                                                 dtype=torch.float32).eval()


def test_2026_model_exports_with_its_modeling_file(exports, remote_model):
    directory = exports("r26")
    source = (directory / MODELING_FILE).read_text()
    assert source == modeling_source()  # gpt.py's architecture written into it
    # the model's arithmetic only: no CPU training kernel (nanochat/cpu_kernels.py), nothing of nanochat imported
    for kernel in ("autograd.Function", "RMSNorm(", "DENSE_ROWS", "baddbmm", "import nanochat", "from nanochat"):
        assert kernel not in source, kernel
    config = json.loads((directory / "config.json").read_text())
    stem = MODELING_FILE.removesuffix(".py")
    assert config["auto_map"] == {"AutoConfig": f"{stem}.NanoChatGPTConfig", "AutoModel": f"{stem}.NanoChatGPTModel",
                                  "AutoModelForCausalLM": f"{stem}.NanoChatGPTForCausalLM"}
    parts = (config["qk_scale"], config["layer_scalars"], config["value_embeds"], config["rope_base"])
    assert parts == (1.2, True, True, 100000.0)
    assert type(remote_model).__name__ == "NanoChatGPTForCausalLM"
    assert "trust_remote_code=True" in (directory / "README.md").read_text()
    assert not any(p.name.endswith(".py") for p in exports("rope").iterdir())  # the plain layout has no code


def test_the_remote_layout_loads_as_the_model_card_says_without_warnings(exports, remote_model, tmp_path, monkeypatch):
    # AutoTokenizer reads config.json's class too: without trust_remote_code it asked on stdin, then fell back to a
    # config of type "" and warned "You are using a model of type `nanochat_gpt` to instantiate a model of type ``"
    import io
    import logging

    import transformers.dynamic_module_utils as modules
    monkeypatch.setattr(modules, "HF_MODULES_CACHE", str(tmp_path))
    directory = exports("r26")
    captured = io.StringIO()
    handler = logging.StreamHandler(captured)
    logging.getLogger("transformers").addHandler(handler)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert "model of type" not in captured.getvalue(), captured.getvalue()
    assert "AutoTokenizer.from_pretrained(path, trust_remote_code=True)" in (directory / "README.md").read_text()
    assert tokenizer("The function")["input_ids"][0] == tokenizer.bos_token_id


def test_remote_model_matches_our_logits_and_greedy_tokens(recipe_base, remote_model):
    model, tokenizer, _ = ours(recipe_base, "r26")
    torch.manual_seed(0)
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, model.config.sequence_len))  # the full context
    ids[:, 0] = tokenizer.get_bos_token_id()
    with torch.no_grad():
        logits = model(ids)
        assert (logits - remote_model(ids).logits).abs().max().item() <= 1e-5
        # its cache: the prefix, then a chunk of 7 after it, then one token
        first = remote_model(ids[:, :40], use_cache=True)
        chunk = remote_model(ids[:, 40:47], cache=first.cache, use_cache=True)
        one = remote_model(ids[:, 47:48], cache=chunk.cache, use_cache=True)
    assert (torch.cat([first.logits, chunk.logits, one.logits], 1) - logits[:, :48]).abs().max().item() <= 1e-5
    lengths = []  # the tokens each forward reads: with the cache, the prompt once and then one at a time
    hook = remote_model.register_forward_pre_hook(
        lambda _, args, kwargs: lengths.append((args[0] if args else kwargs["input_ids"]).size(1)), with_kwargs=True)
    try:
        for prompt in (tokenizer.encode("The function", prepend="<|bos|>"),
                       tokenizer.render_for_completion({"messages": [{"role": "user", "content": "What is 2+2?"}]})):
            columns = Engine(model, tokenizer).generate(prompt, max_tokens=20, temperature=0)
            engine_tokens = [column[0] for column, _ in columns]
            assert list(generate_naive(model, prompt, 20, temperature=0)) == engine_tokens
            lengths.clear()
            batch = torch.tensor([prompt, prompt])
            out = remote_model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=20,
                                        do_sample=False)
            assert out[:, len(prompt):].tolist() == [engine_tokens] * 2
            assert lengths == [len(prompt)] + [1] * 19
    finally:
        hook.remove()


def test_windowed_model_exports_with_its_modeling_file(recipe_base, exports, tmp_path_factory):
    """
    Sliding windows have no field in transformers' NanoChat config: the remote layout, whose copy of gpt.py's attention
    applies them, on the full context and through its cache past the window.
    """
    import transformers.dynamic_module_utils as modules
    model, tokenizer, _ = ours(recipe_base, "win")
    assert json.loads((exports("win") / "config.json").read_text())["window_pattern"] == "S"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modules, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules_win")))
        remote = transformers.AutoModelForCausalLM.from_pretrained(exports("win"), trust_remote_code=True,
                                                                   dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, 160))
    with torch.no_grad():
        logits = model(ids)
        assert (logits - remote(ids).logits).abs().max().item() <= 1e-5
        first = remote(ids[:, :140], use_cache=True)
        one = remote(ids[:, 140:141], cache=first.cache, use_cache=True)
    assert (torch.cat([first.logits, one.logits], 1) - logits[:, :141]).abs().max().item() <= 1e-5


ATTENTION = ("sdpa", "eager", "flex_attention")
# Every layout with every implementation, but flex_attention on r26: the remote layout's attention call is one for
# every model (qk_scale scales q and k before it), and "win" makes it through flex_attention both with a window and
# without one (its last layer), so r26 would compile and check the same call again (~30 s of a cold compile)
CASES = [(tag, attention) for tag in MODELS for attention in ATTENTION if (tag, attention) != ("r26", "flex_attention")]


def load_export(directory, modules_cache, auto="AutoModelForCausalLM", **kwargs):
    """transformers' model of an export (either layout: trust_remote_code is ignored by the plain one), in fp32."""
    import transformers.dynamic_module_utils as modules
    with pytest.MonkeyPatch.context() as mp:  # where transformers copies remote code: not the user's ~/.cache
        mp.setattr(modules, "HF_MODULES_CACHE", str(modules_cache))
        return getattr(transformers, auto).from_pretrained(directory, trust_remote_code=True, dtype=torch.float32,
                                                           **kwargs).eval()


@pytest.mark.parametrize("tag, attention", CASES, ids=[f"{tag}-{attention}" for tag, attention in CASES])
def test_every_attention_implementation_gives_our_logits(recipe_base, exports, tag, attention, tmp_path):
    """
    transformers runs the remote layout's attention (and its own NanoChat's, the plain layout) through its attention
    interface: each implementation computes, over the full context, the fp32 logits of our model run with the kernel
    of the same arithmetic (GPT.attention_kernel: "sdpa" our default, "eager", "flex": nanochat/attention_kernels.py)
    to the bit, and our default's within 1e-5 (the kernels round differently: measured up to 2.4e-6 here); through
    its Cache (windowed layers keep only their window) our greedy tokens, with sdpa and eager: flex_attention is
    compiled afresh at every shape a generation steps through (minutes of a CPU), and its cache path is transformers'
    own, the same for every implementation.
    """
    model, tokenizer, _ = ours(recipe_base, tag)
    hf = load_export(exports(tag), tmp_path, attn_implementation=attention)
    assert hf.config._attn_implementation == attention
    torch.manual_seed(0)
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, model.config.sequence_len))  # the full context
    ids[:, 0] = tokenizer.get_bos_token_id()
    # ours and transformers' compiled flex_attention made afresh for this shape: after calls at other shapes
    # torch.compile makes a kernel for dynamic shapes, which rounds otherwise (seen: 1.8e-6)
    torch._dynamo.reset()
    with torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        logits = model(ids)
        theirs = hf(ids).logits
        model.attention_kernel = KERNELS[{"sdpa": "sdpa", "eager": "eager", "flex_attention": "flex"}[attention]]
        assert (model(ids) - theirs).abs().max().item() == 0.0
        model.attention_kernel = KERNELS["sdpa"]
        assert (logits - theirs).abs().max().item() <= 1e-5
    if attention == "flex_attention":
        return
    with torch.no_grad():
        cut = model.config.sequence_len - 20  # past the window in "win"
        first = hf(ids[:, :cut], use_cache=True)
        one = hf(ids[:, cut:cut + 1], cache=first.cache, use_cache=True)
    assert (torch.cat([first.logits, one.logits], 1) - logits[:, :cut + 1]).abs().max().item() <= 1e-5
    prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": "What is 2+2?"}]})
    engine_tokens = [column[0] for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=12, temperature=0)]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert out[0, len(prompt):].tolist() == engine_tokens


def test_the_base_model_gives_our_hidden_states(recipe_base, exports, tmp_path):
    """AutoModel: the transformer without its head, what serving engines wrap: our final normed hidden states."""
    model, tokenizer, _ = ours(recipe_base, "r26")
    base = load_export(exports("r26"), tmp_path, auto="AutoModel")
    assert type(base).__name__ == "NanoChatGPTModel" and not hasattr(base, "lm_head")
    assert base.config.layer_types == ["full_attention"] * 3 and base.config.sliding_window is None
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, 20))
    with torch.no_grad():
        assert torch.equal(base(ids).last_hidden_state, model._final_hidden(ids))
    windowed = load_export(exports("win"), tmp_path, auto="AutoModel").config
    # nanochat's window of 128 earlier tokens is 129 tokens seen, transformers' sliding_window
    assert (windowed.layer_types, windowed.sliding_window) == (["sliding_attention"] * 2 + ["full_attention"], 129)


def test_remote_model_refuses_padding(remote_model):
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    with pytest.raises(ValueError, match="padded batches"):
        remote_model.generate(ids, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), max_new_tokens=2)


def test_rope_base_alone_exports_plain(recipe_base, exports):
    model, tokenizer, _ = ours(recipe_base, "rope")
    directory = exports("rope")
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "nanochat" and config["rope_parameters"]["rope_theta"] == 100000.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(hf).__name__ == "NanoChatForCausalLM"
    ids = torch.randint(0, tokenizer.get_vocab_size(), (2, model.config.sequence_len))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tag", MODELS)
def test_export_import_round_trip(recipe_base, exports, tag, monkeypatch):
    model, _, _ = ours(recipe_base, tag)
    run_in_process("scripts.import_model", f"--path={exports(tag)}", "--source=sft", "--model_tag=back",
                   monkeypatch=monkeypatch)
    back, _, _ = load_model("sft", "cpu", phase="eval", model_tag="back")
    assert back.config == model.config
    assert back.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_plain_layouts_refuse_the_2026_parts(recipe_base, tmp_path, monkeypatch):
    base = tmp_path / "base"
    shutil.copytree(recipe_base, base)
    error = one_line_error(run_script("-m", "scripts.export_model", "--source=base", "--model_tag=r26",
                                      f"--out={tmp_path / 'out'}", "--layout=hf", env={"NANOCHAT_BASE_DIR": base}))
    assert "qk_scale=1.2, layer_scalars=True, value_embeds=True has no equivalent" in error
    assert "--layout=remote" in error
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    with pytest.raises(UserError, match=r"has no equivalent .*nor mlx-lm.s.*--layout=remote"):
        run_in_process("scripts.export_model", "--source=base", "--model_tag=r26", f"--out={tmp_path / 'out'}",
                      "--layout=mlx", monkeypatch=monkeypatch)
    assert not (tmp_path / "out").exists()
    bad = tmp_path / "bad"  # a remote-layout config.json our GPT cannot take
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "nanochat_gpt", "n_layer": 2}))
    with pytest.raises(UserError, match="lacks sequence_len, vocab_size, n_head"):
        run_in_process("scripts.import_model", f"--path={bad}", "--source=sft", monkeypatch=monkeypatch)
