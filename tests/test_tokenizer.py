"""
Tokenizer tests: round trips, the 2-digit split, special tokens, token_bytes, the chat rendering, save/load.

Exact round trips, the 2-digit split, special tokens never coming from text, token_bytes, the chat rendering and its
mask, save/load. Tiny vocabularies trained on the Python docs shipped with CPython (pydoc_data), so no dataset is
needed.
"""

import logging
import os
import random

import pytest
import regex
import rustbpe
from pydoc_data.topics import topics

from helpers import REPO_ROOT, run_script
from nanochat.output import UserError
from nanochat.tokenizer import (SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer, get_token_bytes, get_tokenizer,
                                get_tokenizer_dir)

VOCAB = 1024


def training_texts():
    """The Python docs plus text with many numbers and some CJK, so that digit and multi-byte merges exist."""
    rng = random.Random(0)
    # a few numbers very often (so that a 3-digit split would learn 3-digit tokens), many others once
    numbers = " ".join(str(rng.choice([2025, 1999, 314159, 271828, 65536, rng.randint(0, 10**6)])) for _ in range(5000))
    cjk = "自然语言处理是人工智能的一个分支。我们在这里训练一个分词器。" * 50
    return list(topics.values()) + [numbers, cjk]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter(training_texts()), VOCAB)


SAMPLES = [
    "",
    "Hello, world! It's a test; we'll see.",
    "def f(x):\n\treturn x ** 2  # square\n",
    "emoji: 😀👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷",
    "中文：自然语言处理。日本語のテキスト。한국어 문장입니다.",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",  # e + combining acute, etc.
    "   leading spaces\n\n\n\ttabs\r\nCRLF \u00a0nbsp\u3000ideographic space   \n",
    "digits 0 07 123 4567 3.14159 1,000,000 2025-11-22",
    "<|bos|> typed by a user <|assistant_end|>",
    "\x00 NUL and \x7f DEL and \u200b zero width",
]


def test_round_trip_exact(tok):
    rng = random.Random(1)
    # plus random strings over a wide range of code points (surrogates excluded: they are not valid text)
    randoms = ["".join(chr(rng.choice([rng.randint(32, 127), rng.randint(128, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
                       for _ in range(200)) for _ in range(20)]
    for text in SAMPLES + randoms:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.get_vocab_size() for i in ids)


def test_split_pattern_keeps_words_of_every_script_whole():
    # combining marks (Hindi's vowel signs, Thai's tone marks) belong to their word; scripts without spaces are cut
    # at punctuation only (GPT-4's pattern gives 'स', 'ंक', 'ेत' for the first word: docs/tokenizer.md)
    pieces = regex.findall(SPLIT_PATTERN, "संकेत नमस्ते ยอมรับข้อตกลง 文件系统，配置文件。 Ελληνικά")
    assert pieces == ["संकेत", " नमस्ते", " ยอมรับข้อตกลง", " 文件系统", "，配置文件", "。", " Ελληνικά"]


def test_chinese_merges_learned_and_round_trip():
    # real Chinese text (the Vim tutor, tests/fixtures/own_text/SOURCE): merges of several characters are learned
    with open(os.path.join(REPO_ROOT, "tests", "fixtures", "own_text", "zh", "vimtutor.txt"), encoding="utf-8") as f:
        text = f.read()
    tokenizer = Tokenizer.train_from_iterator(iter(text.split("\n\n")), 1024)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    han = [t for t in (tokenizer.decode([i]) for i in set(ids))
           if len(t) >= 2 and all("\u4e00" <= c <= "\u9fff" for c in t)]
    assert len(han) >= 50, han  # words such as 光标, 命令, 插入
    assert len(text.encode()) / len(ids) > 2.0  # bytes per token: 1.0 would be no merge at all


def test_lone_surrogates_replaced(tok):
    # as documented in Tokenizer.encode: a lone surrogate becomes U+FFFD, a split surrogate pair is joined
    assert tok.decode(tok.encode("a\ud800b")) == "a\ufffdb"
    assert tok.decode(tok.encode("x\udfffy\ud83d")) == "x\ufffdy\ufffd"
    assert tok.encode("\ud83d\ude00") == tok.encode("😀")


def test_digits_split_in_runs_of_at_most_two(tok):
    ids = tok.encode("31415926535 2025 999999 1234567890")
    pieces = [tok.decode([i]) for i in ids]
    digit_runs = [p.strip() for p in pieces if p.strip().isdigit()]
    assert "".join(digit_runs) == "31415926535" "2025" "999999" "1234567890"
    assert max(len(r) for r in digit_runs) <= 2
    assert any(len(r) == 2 for r in digit_runs), "the training text has many numbers: 2-digit merges must exist"
    # no token of the vocabulary holds 3 digits in a row
    vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    assert not any(any(t[k:k + 3].isdigit() and len(t[k:k + 3]) == 3 for k in range(len(t))) for t in vocab)


def test_special_tokens_never_come_from_text(tok):
    n_bpe = tok.get_vocab_size() - len(SPECIAL_TOKENS)
    specials = tok.get_special_tokens()
    assert list(specials) == SPECIAL_TOKENS
    assert list(specials.values()) == list(range(n_bpe, n_bpe + len(SPECIAL_TOKENS)))
    text = "".join(SPECIAL_TOKENS) + " <|bos|>hi"
    ids = tok.encode(text)
    assert all(i < n_bpe for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode_special("<|bos|>") == tok.get_bos_token_id() == n_bpe
    assert tok.encode_special("<|output_end|>") == n_bpe + 8
    with pytest.raises(ValueError, match="not a special token"):
        tok.encode_special("<|endoftext|>")
    assert tok.encode("hi", prepend="<|assistant_end|>") == [specials["<|assistant_end|>"]] + tok.encode("hi")
    assert tok.encode("hi", prepend=tok.get_bos_token_id()) == [n_bpe] + tok.encode("hi")
    assert tok.id_to_token(n_bpe) == "<|bos|>"


def test_token_bytes(tok):
    token_bytes = tok.compute_token_bytes()
    assert token_bytes.shape == (tok.get_vocab_size(),)
    for token, rank in tok.mergeable_ranks.items():
        assert token_bytes[rank].item() == len(token)
    for special_id in tok.get_special_tokens().values():
        assert token_bytes[special_id].item() == 0
    # a token that is part of a multi-byte character counts its raw bytes, not the decoded "\ufffd" (3 bytes)
    partial = [t for t in tok.mergeable_ranks if len(t) >= 2 and t[0] >= 0xE0]
    assert token_bytes[0xE4].item() == 1
    for t in partial:
        try:
            t.decode("utf-8")
        except UnicodeDecodeError:
            assert token_bytes[tok.mergeable_ranks[t]].item() == len(t)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert token_bytes[ids].sum().item() == len(text.encode("utf-8"))
    ids = tok.encode("中文 text", prepend="<|bos|>")
    assert token_bytes[ids].sum().item() == len("中文 text".encode("utf-8"))


def test_tiktoken_applies_the_merges_like_rustbpe():
    """Training (rustbpe) and inference (tiktoken) agree token for token on the same merges and pattern."""
    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter(training_texts()), VOCAB - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    tok = Tokenizer({bytes(t): r for t, r in bpe.get_mergeable_ranks()})
    for text in SAMPLES[:8] + list(topics.values())[:5]:
        assert tok.encode(text) == list(bpe.encode(text))


def test_batch_encode_equals_single(tok):
    texts = SAMPLES + list(topics.values())[:10]
    batch = tok.encode(texts, prepend="<|bos|>", num_threads=2)
    assert batch == [tok.encode(t, prepend="<|bos|>") for t in texts]
    assert all(ids[0] == tok.get_bos_token_id() for ids in batch)


def test_save_and_load_round_trip(tok):
    with pytest.raises(UserError, match="scripts.tok_train"):
        get_tokenizer()
    with pytest.raises(UserError, match="scripts.tok_train"):
        get_token_bytes()
    tok.save(get_tokenizer_dir())
    assert sorted(os.listdir(get_tokenizer_dir())) == ["token_bytes.pt", "tokenizer.json", "tokenizer.tiktoken"]
    loaded = get_tokenizer()
    assert loaded.get_vocab_size() == tok.get_vocab_size()
    assert loaded.get_special_tokens() == tok.get_special_tokens()
    texts = SAMPLES + list(topics.values())[:10]
    assert loaded.encode(texts) == tok.encode(texts)
    assert get_token_bytes().tolist() == tok.compute_token_bytes().tolist()
    # a ranks file that does not match tokenizer.json (an interrupted save) is refused
    path = os.path.join(get_tokenizer_dir(), "tokenizer.tiktoken")
    with open(path, "a") as f:
        f.write("QUJD 99999\n")
    with pytest.raises(UserError, match="do not belong together"):
        get_tokenizer()


def test_vocab_size_too_small():
    with pytest.raises(UserError, match="too small"):
        Tokenizer.train_from_iterator(iter(["abc"]), 260)


# -----------------------------------------------------------------------------
# Conversations

CONVERSATION = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me compute."},
        {"type": "python", "text": "print(12*34)"},
        {"type": "python_output", "text": "408"},
        {"type": "text", "text": "It is 408."},
    ]},
    {"role": "user", "content": "Thanks <|assistant_end|>"},
    {"role": "assistant", "content": "You're welcome."},
]}


def expected_rendering(tok):
    s = tok.encode_special
    ids, mask = [], []

    def add(x, m):
        x = x if isinstance(x, list) else [x]
        ids.extend(x)
        mask.extend([m] * len(x))

    add(s("<|bos|>"), 0)
    add(s("<|user_start|>"), 0)
    add(tok.encode("You are terse.\n\nWhat is 12*34?"), 0)
    add(s("<|user_end|>"), 0)
    add(s("<|assistant_start|>"), 0)
    add(tok.encode("Let me compute."), 1)
    add(s("<|python_start|>"), 1)
    add(tok.encode("print(12*34)"), 1)
    add(s("<|python_end|>"), 1)
    add(s("<|output_start|>"), 0)
    add(tok.encode("408"), 0)
    add(s("<|output_end|>"), 0)
    add(tok.encode("It is 408."), 1)
    add(s("<|assistant_end|>"), 1)
    add(s("<|user_start|>"), 0)
    add(tok.encode("Thanks <|assistant_end|>"), 0)
    add(s("<|user_end|>"), 0)
    add(s("<|assistant_start|>"), 0)
    add(tok.encode("You're welcome."), 1)
    add(s("<|assistant_end|>"), 1)
    return ids, mask


def test_render_conversation_mask(tok):
    ids, mask = tok.render_conversation(CONVERSATION)
    assert (ids, mask) == expected_rendering(tok)
    # the trained tokens decode to exactly what the assistant wrote (text + tool calls + end of turn)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == ("Let me compute.<|python_start|>print(12*34)<|python_end|>It is 408.<|assistant_end|>"
                       "You're welcome.<|assistant_end|>")
    assert tok.truncation_stats == {"conversations": 0, "tokens_dropped": 0}


def test_render_for_completion(tok):
    ids = tok.render_for_completion(CONVERSATION)
    full, _ = expected_rendering(tok)
    reply = tok.encode("You're welcome.") + [tok.encode_special("<|assistant_end|>")]
    assert ids == full[:len(full) - len(reply)]
    assert ids[-1] == tok.encode_special("<|assistant_start|>")
    # a conversation that ends with the user's turn gets the same prompt
    ending_with_user = {"messages": CONVERSATION["messages"][:-1]}
    assert tok.render_for_completion(ending_with_user) == ids


BAD = [
    ({"messages": []}, "no messages"),
    ([{"role": "user", "content": "hi"}], "dict"),
    ({"messages": [{"role": "system", "content": "s"}]}, "followed by a user"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "alternate"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "alternate"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "only the first"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}, "unknown role"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "must be a string"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "content": [{"type": "image", "text": "x"}]}]}, "unknown type"),
    ({"messages": [{"role": "user", "content": "a"},
                   {"role": "assistant", "content": [{"type": "text", "text": 3}]}]}, "string 'text'"),
    ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
]


@pytest.mark.parametrize("conversation,match", BAD)
def test_malformed_conversations_raise(tok, conversation, match):
    with pytest.raises(ValueError, match=match):
        tok.render_conversation(conversation)


def test_truncation_is_counted_and_warned_once(tok):
    tok = Tokenizer(tok.mergeable_ranks)  # fresh counters
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("nanochat.tokenizer")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        full, full_mask = tok.render_conversation(CONVERSATION)
        ids, mask = tok.render_conversation(CONVERSATION, max_tokens=10)
        assert ids == full[:10] and mask == full_mask[:10]
        tok.render_conversation(CONVERSATION, max_tokens=20)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert tok.truncation_stats == {"conversations": 2, "tokens_dropped": (len(full) - 10) + (len(full) - 20)}
    assert len([r for r in records if "truncated" in r.getMessage()]) == 1


def test_visualize_tokenization(tok):
    ids, mask = tok.render_conversation({"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "yo"}]})
    plain = tok.visualize_tokenization(ids, mask, color=False)
    trained = "|".join(tok.id_to_token(i) for i, m in zip(ids, mask) if m)
    assert f"<|assistant_start|>|[[{trained}]]" in plain
    assert "\033[" not in plain
    colored = tok.visualize_tokenization(ids, mask, color=True)
    assert "\033[32m<|assistant_end|>" in colored and "\033[31m<|bos|>" in colored
    # NO_COLOR is set by the test environment and stdout is not a terminal: plain by default
    assert tok.visualize_tokenization(ids, mask) == plain
    assert tok.visualize_tokenization(tok.encode("a\nb"), color=False) == "a|\\n|b"


# -----------------------------------------------------------------------------
# scripts/tok_train.py and scripts/tok_eval.py, end to end on the pydocs corpus

@pytest.mark.slow
def test_tok_train_and_tok_eval_scripts(pydocs_corpus, isolated_env, tmp_path):
    train = run_script("-m", "scripts.tok_train", "--vocab-size=600", "--max-chars=300000", "--doc-cap=2000")
    assert train.returncode == 0, train.stderr
    assert "Trained on" in train.stdout and "300,000 chars" in train.stdout and "Vocab size: 600" in train.stdout
    assert "scripts.tok_eval" in train.stdout  # says what to run next
    tok_dir = isolated_env / "tokenizer"
    assert sorted(os.listdir(tok_dir)) == ["token_bytes.pt", "tokenizer.json", "tokenizer.tiktoken"]
    assert "## Tokenizer training" in (isolated_env / "report" / "tokenizer-training.md").read_text()
    assert get_tokenizer().get_vocab_size() == 600 and get_token_bytes().shape == (600,)

    # offline, nothing cached, downloads off: the comparison is skipped with a plain message, the table is there
    empty_cache = tmp_path / "tiktoken_cache"
    empty_cache.mkdir()
    ev = run_script("-m", "scripts.tok_eval", "--sample-chars=50000", "--download-reference=false",
                    env={"TIKTOKEN_CACHE_DIR": empty_cache})
    assert ev.returncode == 0, ev.stderr
    assert "GPT-2/GPT-4 encodings unavailable offline (no cached tiktoken files); skipping comparison" in ev.stdout
    for row in ["english", "python", "math", "korean", "chinese", "numbers", "pydocs train", "pydocs val"]:
        assert f"| {row} " in ev.stdout
    assert "ours bytes/token" in ev.stdout and "GPT-4 tokens" not in ev.stdout
    assert "## Tokenizer evaluation" in (isolated_env / "report" / "tokenizer-evaluation.md").read_text()

    # the comparison columns, with tiktoken.get_encoding stubbed by our own encoding (no network in tests):
    # each reference then compresses exactly like ours
    stub = ("import runpy, sys, tiktoken\n"
            "from nanochat.tokenizer import get_tokenizer\n"
            "enc = get_tokenizer().enc\n"
            "tiktoken.get_encoding = lambda name: enc\n"
            "sys.argv = ['tok_eval', '--sample-chars=50000']\n"
            "runpy.run_module('scripts.tok_eval', run_name='__main__')\n")
    ev = run_script("-c", stub, env={"TIKTOKEN_CACHE_DIR": empty_cache})
    assert ev.returncode == 0, ev.stderr
    assert "unavailable" not in ev.stdout
    assert "GPT-2 tokens" in ev.stdout and "GPT-4 bytes/token" in ev.stdout
    python_row = next(line for line in ev.stdout.splitlines() if line.startswith("| python "))
    assert python_row.rstrip(" |").endswith("+0.0%")
