"""
The tokenizer: text <-> token ids (a byte-level BPE), and conversations -> (ids, mask) for chat training.

Ids 0..255 are the bytes, then the merges, then SPECIAL_TOKENS; special tokens never come out of ordinary text (a
typed "<|bos|>" is seven characters). Files under $NANOCHAT_BASE_DIR/tokenizer/ (tok_train writes them):
tokenizer.tiktoken, token_bytes.pt, tokenizer.json. The split pattern, the files and the chat format: docs/tokenizer.md.
"""

import base64
import hashlib
import json
import logging
import os
import shutil
import sys

import tiktoken
import torch

from nanochat.files import atomic_write, get_base_dir
from nanochat.output import UserError, _use_color, error_line

logger = logging.getLogger(__name__)

# How text is cut into pieces before BPE (merges never cross a piece boundary), for training (rustbpe) and encoding
# (tiktoken) alike: GPT-4's pattern with numbers in runs of at most 2 digits, and combining marks (\p{M}: Hindi's
# vowel signs, Thai's tone marks) counted as letters, as GPT-4o's pattern does (docs/tokenizer.md explains it)
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{M}\p{N}]?+[\p{L}\p{M}]+|\p{N}{1,2}"""
                 r"""| ?[^\s\p{L}\p{M}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")

# Appended after the BPE tokens, in this order: <|bos|> gets id n_bpe, <|user_start|> n_bpe + 1, ...
SPECIAL_TOKENS = [
    "<|bos|>",            # begins every document and every conversation
    "<|user_start|>",     # a user turn
    "<|user_end|>",
    "<|assistant_start|>",  # an assistant turn
    "<|assistant_end|>",
    "<|python_start|>",   # the assistant calls the python tool
    "<|python_end|>",
    "<|output_start|>",   # the tool's output, written into the conversation (not predicted by the model)
    "<|output_end|>",
]

DEFAULT_VOCAB_SIZE = 65536  # including the special tokens; 2**16 ids also fit in a uint16

RANKS_FILE = "tokenizer.tiktoken"
META_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.pt"

TRAIN_HINT = "train one with `python -m scripts.tok_train`"


class Tokenizer:
    """
    A trained BPE tokenizer: Tokenizer.train_from_iterator, Tokenizer.from_directory, or get_tokenizer() for the one
    tok_train saved. `truncation_stats`: {"conversations", "tokens_dropped"} cut off by render_conversation so far.
    """

    def __init__(self, mergeable_ranks, pattern=SPLIT_PATTERN):
        """`mergeable_ranks`: {token bytes: rank} with ranks exactly 0..n-1 (ids 0..255 are the 256 bytes)."""
        ranks = sorted(mergeable_ranks.values())
        if ranks != list(range(len(ranks))):
            raise ValueError("mergeable ranks must be exactly 0..n-1")
        self.mergeable_ranks = dict(mergeable_ranks)
        self.pattern = pattern
        n = len(mergeable_ranks)
        self.special_tokens = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding(name="nanochat", pat_str=pattern, mergeable_ranks=self.mergeable_ranks,
                                     special_tokens=self.special_tokens)
        self.truncation_stats = {"conversations": 0, "tokens_dropped": 0}
        self.directory = None  # where from_directory read it (None: built in memory); error messages name it

    # -------------------------------------------------------------------------
    # Training, saving, loading

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size=DEFAULT_VOCAB_SIZE):
        """
        A tokenizer whose BPE merges rustbpe learns from an iterator of strings (documents): vocab_size -
        len(SPECIAL_TOKENS) - 256 merges, fewer (with a warning) if the text runs out of pairs; get_vocab_size()
        tells the real size. UserError for a vocab_size below 256 + the special tokens + 1.
        """
        import rustbpe  # only training needs it

        min_size = 256 + len(SPECIAL_TOKENS) + 1
        if vocab_size < min_size:
            raise UserError(f"vocab_size={vocab_size} is too small: the 256 byte tokens and {len(SPECIAL_TOKENS)} "
                            f"special tokens alone take {min_size - 1}; use at least {min_size}")
        bpe = rustbpe.Tokenizer()
        bpe_vocab_size = vocab_size - len(SPECIAL_TOKENS)
        bpe.train_from_iterator(text_iterator, bpe_vocab_size, pattern=SPLIT_PATTERN)
        mergeable_ranks = {bytes(token): rank for token, rank in bpe.get_mergeable_ranks()}
        if len(mergeable_ranks) < bpe_vocab_size:
            logger.warning(f"the training text only allowed {len(mergeable_ranks) - 256} merges of the "
                           f"{bpe_vocab_size - 256} asked for: "
                           f"vocab size is {len(mergeable_ranks) + len(SPECIAL_TOKENS)}, "
                           f"not {vocab_size} (train on more text)")
        return cls(mergeable_ranks)

    def save(self, path):
        """
        Write the tokenizer to directory `path`: tokenizer.tiktoken, token_bytes.pt, then tokenizer.json, each all or
        nothing; tokenizer.json records the sha256 of tokenizer.tiktoken, so a save that died half-way is detected.
        """
        os.makedirs(path, exist_ok=True)
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        ranks_text = "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n"
                             for token, rank in by_rank).encode("ascii")
        with atomic_write(os.path.join(path, RANKS_FILE)) as f:
            f.write(ranks_text)
        with atomic_write(os.path.join(path, TOKEN_BYTES_FILE)) as f:
            torch.save(self.compute_token_bytes(), f)
        meta = {
            "pattern": self.pattern,
            "special_tokens": SPECIAL_TOKENS,
            "vocab_size": self.get_vocab_size(),
            "ranks_sha256": hashlib.sha256(ranks_text).hexdigest(),
        }
        with atomic_write(os.path.join(path, META_FILE), "w") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
        logger.info(f"Saved tokenizer (vocab {self.get_vocab_size():,}) to {path}")

    @classmethod
    def from_directory(cls, path):
        """Load a tokenizer written by save(). Missing, garbage or inconsistent files raise UserError."""
        meta_path = os.path.join(path, META_FILE)
        ranks_path = os.path.join(path, RANKS_FILE)
        if not os.path.exists(meta_path) or not os.path.exists(ranks_path):
            raise UserError(f"no tokenizer in {path}: {TRAIN_HINT}")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
            ranks_sha256 = meta["ranks_sha256"]
            pattern = meta["pattern"]
            special_tokens = meta["special_tokens"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{meta_path} is not a tokenizer file written by tok_train ({type(e).__name__}: {e}); "
                            f"{TRAIN_HINT} to write a new one") from None
        with open(ranks_path, "rb") as f:
            ranks_text = f.read()
        if hashlib.sha256(ranks_text).hexdigest() != ranks_sha256:
            raise UserError(f"tokenizer files in {path} do not belong together (a save was interrupted?): {TRAIN_HINT}")
        if special_tokens != SPECIAL_TOKENS:
            raise UserError(f"the tokenizer in {path} has special tokens {special_tokens}, this code expects "
                            f"{SPECIAL_TOKENS}: {TRAIN_HINT}")
        mergeable_ranks = {}
        for line in ranks_text.splitlines():
            token, rank = line.split()
            mergeable_ranks[base64.b64decode(token)] = int(rank)
        # encode with the pattern the merges were learned with (SPLIT_PATTERN for anything tok_train saved)
        tokenizer = cls(mergeable_ranks, pattern=pattern)
        tokenizer.directory = os.path.abspath(path)
        return tokenizer

    def fingerprint(self):
        """
        16 hex digits hashing everything that decides which id a text gets (merges, split pattern, special tokens);
        checkpoints record it, so a model never runs with another tokenizer than it was trained with.
        """
        h = hashlib.sha256()
        for token, rank in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(base64.b64encode(token) + b" %d\n" % rank)
        h.update(self.pattern.encode("utf-8"))
        h.update(json.dumps(self.special_tokens, sort_keys=True).encode("utf-8"))
        return h.hexdigest()[:16]

    def compute_token_bytes(self):
        """int32 tensor [vocab_size]: the number of raw bytes of each token (not of its text), 0 for special tokens."""
        token_bytes = torch.zeros(self.get_vocab_size(), dtype=torch.int32)
        for token, rank in self.mergeable_ranks.items():
            token_bytes[rank] = len(token)
        return token_bytes

    # -------------------------------------------------------------------------
    # Encoding and decoding

    def get_vocab_size(self):
        """Number of ids: 256 bytes + merges + special tokens."""
        return self.enc.n_vocab

    def get_special_tokens(self):
        """{special token string: id}, in SPECIAL_TOKENS order."""
        return dict(self.special_tokens)

    def encode_special(self, name):
        """The id of special token `name`, e.g. encode_special("<|bos|>")."""
        if name not in SPECIAL_TOKENS:
            raise ValueError(f"{name!r} is not a special token; they are {SPECIAL_TOKENS}")
        return self.special_tokens[name]

    def get_bos_token_id(self):
        """The id of <|bos|>, which begins every document and every conversation."""
        return self.encode_special("<|bos|>")

    def id_to_token(self, token_id):
        """A readable string for one token: invalid UTF-8 bytes as \\xNN escapes, special tokens as their name."""
        return self.enc.decode_single_token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def _as_id(self, token):
        return self.encode_special(token) if isinstance(token, str) else int(token)

    def encode(self, text_or_list, prepend=None, num_threads=8):
        """
        str -> list[int]; list[str] -> list[list[int]] (encoded in parallel by tiktoken, `num_threads`). `prepend`:
        a token id or a special token string (e.g. "<|bos|>") put before each sequence. Always ordinary text:
        special-token strings in it are plain characters. decode(encode(s)) == s for every valid string; lone
        surrogates (e.g. "\\ud800") are repaired as tiktoken does (pairs joined, a lone one becomes U+FFFD "\ufffd").
        """
        pre = None if prepend is None else self._as_id(prepend)

        def wrap(ids):
            if pre is not None:
                ids.insert(0, pre)
            return ids

        if isinstance(text_or_list, str):
            return wrap(self.enc.encode_ordinary(text_or_list))
        if isinstance(text_or_list, (list, tuple)):
            return [wrap(ids) for ids in self.enc.encode_ordinary_batch(list(text_or_list), num_threads=num_threads)]
        raise TypeError(f"encode expects a str or a list of str, got {type(text_or_list).__name__}")

    def decode(self, ids):
        """list[int] -> str. Special tokens come out as their names; an incomplete UTF-8 sequence as U+FFFD."""
        return self.enc.decode([int(i) for i in ids])  # int(): also takes a tensor or numpy ids

    # -------------------------------------------------------------------------
    # Conversations

    def _validated_messages(self, conversation):
        """The conversation's messages, a leading system message merged into the first user message; else ValueError."""
        if not isinstance(conversation, dict) or not isinstance(conversation.get("messages"), list):
            raise ValueError("a conversation is a dict {'messages': [...]}")
        messages = conversation["messages"]
        if not messages:
            raise ValueError("conversation has no messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"message {i} must be a dict with 'role' and 'content'")
            if message["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"message {i} has unknown role {message['role']!r} (system, user, assistant)")
            if message["role"] == "system" and i != 0:
                raise ValueError(f"message {i} is a system message: only the first message may be one")
        if messages[0]["role"] == "system":
            system = messages[0]["content"]
            user = messages[1]["content"] if len(messages) > 1 else None
            if len(messages) < 2 or messages[1]["role"] != "user":
                raise ValueError("the system message must be followed by a user message")
            if not isinstance(system, str) or not isinstance(user, str):
                raise ValueError("the system message and the user message after it must be strings")
            messages = [{"role": "user", "content": system + "\n\n" + user}] + messages[2:]
        for i, message in enumerate(messages):
            expected = "user" if i % 2 == 0 else "assistant"
            if message["role"] != expected:
                raise ValueError(f"roles must alternate user/assistant starting with user (after the optional "
                                 f"system message); message {i} is {message['role']!r}, expected {expected!r}")
            content = message["content"]
            if expected == "user":
                if not isinstance(content, str):
                    raise ValueError(f"user message {i} content must be a string, got {type(content).__name__}")
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, dict) or part.get("type") not in ("text", "python", "python_output"):
                        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                        raise ValueError(f"assistant message {i} part {j} has unknown type {kind!r} "
                                         f"(text, python, python_output)")
                    if not isinstance(part.get("text"), str):
                        raise ValueError(f"assistant message {i} part {j} needs a string 'text'")
            elif not isinstance(content, str):
                raise ValueError(f"assistant message {i} content must be a string or a list of parts")
        return messages

    def _render_messages(self, messages):
        """Tokens and mask of validated messages (no truncation)."""
        ids, mask = [], []

        special = self.special_tokens

        def add(token_ids, m):
            ids.extend(token_ids)
            mask.extend([m] * len(token_ids))

        def block(name, text, m):  # <|name_start|> text <|name_end|>, every token with mask m
            add([special[f"<|{name}_start|>"], *self.encode(text), special[f"<|{name}_end|>"]], m)

        add([special["<|bos|>"]], 0)
        for message in messages:
            content = message["content"]
            if message["role"] == "user":
                block("user", content, 0)
                continue
            add([special["<|assistant_start|>"]], 0)  # given at sampling time, so never a target
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    add(self.encode(part["text"]), 1)
                elif part["type"] == "python":  # the model writes the tool call: trained
                    block("python", part["text"], 1)
                else:  # python_output: the tool writes it, the model only reads it
                    block("output", part["text"], 0)
            add([special["<|assistant_end|>"]], 1)  # the model must learn to end its turn
        return ids, mask

    def render_conversation(self, conversation, max_tokens=2048):
        """
        Conversation -> (ids, mask), two lists of equal length, at most max_tokens (a cut is counted in
        truncation_stats; the first is logged). mask[i] = 1 where ids[i] is what the assistant writes (its text, its
        python calls, <|assistant_end|>), 0 elsewhere (<|bos|>, user turns, <|assistant_start|>, tool outputs).
        conversation = {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}: an optional system
        message first (merged into the first user message as "system\\n\\nuser"), then user and assistant alternate
        starting with user. User content is a string; assistant content a string or a list of parts {"type": "text"|
        "python"|"python_output", "text": str}. A malformed conversation raises ValueError. Format: docs/tokenizer.md.
        """
        ids, mask = self._render_messages(self._validated_messages(conversation))
        if len(ids) > max_tokens:
            if self.truncation_stats["conversations"] == 0:
                logger.warning(f"conversation of {len(ids):,} tokens truncated to max_tokens={max_tokens:,} "
                               f"(counted in tokenizer.truncation_stats; further truncations are not logged)")
            self.truncation_stats["conversations"] += 1
            self.truncation_stats["tokens_dropped"] += len(ids) - max_tokens
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        return ids, mask

    def render_for_completion(self, conversation):
        """
        The ids of the prompt for sampling the assistant's next reply: the conversation without its last assistant
        message (if it ends with one), ending with <|assistant_start|>. ValueError as for render_conversation.
        """
        messages = self._validated_messages(conversation)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        ids, _ = self._render_messages(messages)
        ids.append(self.encode_special("<|assistant_start|>"))
        return ids

    def visualize_tokenization(self, ids, mask=None, color=None):
        """
        A debug view of a token sequence, one string, tokens separated by "|" (\\n, \\t, \\r shown escaped). With a
        mask: trained tokens green and the others red in colour, or runs of trained tokens in [[ ]] without. `color`:
        None = decide from sys.stdout and NO_COLOR, True/False to force. ValueError if mask and ids differ in length.
        """
        if color is None:
            color = _use_color(sys.stdout)
        if mask is not None and len(mask) != len(ids):
            raise ValueError(f"ids and mask differ in length ({len(ids)} vs {len(mask)})")
        texts = [self.id_to_token(i).replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r") for i in ids]
        if color:
            green = "\033[32m"
            red = "\033[31m"
            cyan = "\033[36m"
            yellow = "\033[33m"
            dim = "\033[2m"
            reset = "\033[0m"
            if mask is None:
                colored = [f"{(cyan, yellow)[k % 2]}{t}{reset}" for k, t in enumerate(texts)]
            else:
                colored = [f"{green if m else red}{t}{reset}" for t, m in zip(texts, mask)]
            return f"{dim}|{reset}".join(colored)
        if mask is None:
            return "|".join(texts)
        out = []
        for k, (t, m) in enumerate(zip(texts, mask)):
            prev = mask[k - 1] if k > 0 else 0
            if k > 0:
                out.append("]]|" if prev and not m else "|")
            if m and not prev:
                out.append("[[")
            out.append(t)
        if mask and mask[-1]:
            out.append("]]")
        return "".join(out)


# -----------------------------------------------------------------------------
# Where a model's tokenizer lives. Every model trained here uses the base dir's tokenizer
# ($NANOCHAT_BASE_DIR/tokenizer/, trained by scripts/tok_train.py); an imported model (scripts/import_model.py) keeps
# its own, in <checkpoint_dir>/tokenizer/ (Tokenizer.save's format), and so does every model trained from it
# (carry_tokenizer). Loading a checkpoint looks there first (checkpoint_tokenizer).

TOKENIZER_SUBDIR = "tokenizer"


def get_tokenizer_dir():
    """$NANOCHAT_BASE_DIR/tokenizer, where tok_train saves the tokenizer."""
    return os.path.join(get_base_dir(), "tokenizer")


def get_tokenizer():
    """The tokenizer saved under $NANOCHAT_BASE_DIR/tokenizer/; UserError if there is none."""
    return Tokenizer.from_directory(get_tokenizer_dir())


def checkpoint_tokenizer(checkpoint_dir):
    """
    The tokenizer of the models in `checkpoint_dir`: <checkpoint_dir>/tokenizer/ if it exists, else the base
    dir's.
    """
    own = os.path.join(checkpoint_dir, TOKENIZER_SUBDIR)
    return Tokenizer.from_directory(own) if os.path.isdir(own) else get_tokenizer()


def carry_tokenizer(tokenizer, checkpoint_dir):
    """
    Make the new checkpoints in `checkpoint_dir` load with `tokenizer`, the tokenizer of the model being trained
    into it. The base dir's tokenizer needs nothing (a <checkpoint_dir>/tokenizer/ an earlier run with another one
    left there is removed, or it would be loaded instead); any other tokenizer is saved to <checkpoint_dir>/tokenizer/.
    Call on rank 0 before the stage's first save_checkpoint.
    """
    own = os.path.join(checkpoint_dir, TOKENIZER_SUBDIR)
    base = get_tokenizer_dir()
    if tokenizer.directory is not None and os.path.realpath(tokenizer.directory) == os.path.realpath(base):
        is_base = True
    else:
        try:
            is_base = Tokenizer.from_directory(base).fingerprint() == tokenizer.fingerprint()
        except UserError:  # no tokenizer in the base dir
            is_base = False
    if is_base:
        if os.path.isdir(own):
            shutil.rmtree(own)
        return
    try:
        if Tokenizer.from_directory(own).fingerprint() == tokenizer.fingerprint():
            return
    except UserError:
        pass  # none there yet, or a broken one: write it
    tokenizer.save(own)


def get_token_bytes(device="cpu", directory=None):
    """
    int32 tensor [vocab_size] on `device`: the bytes of each token id (0 for special tokens), for bits per byte =
    sum(loss) / (ln 2 * sum(token_bytes[targets])). `directory`: default $NANOCHAT_BASE_DIR/tokenizer/; a model with
    its own tokenizer (an imported one) needs `tokenizer.directory` of load_model's tokenizer. UserError if missing.
    """
    path = os.path.join(directory or get_tokenizer_dir(), TOKEN_BYTES_FILE)
    if not os.path.exists(path):
        raise UserError(f"no {path}: {TRAIN_HINT}")
    try:
        token_bytes = torch.load(path, map_location="cpu", weights_only=True)
        if not (isinstance(token_bytes, torch.Tensor) and token_bytes.ndim == 1):
            raise ValueError(f"expected a 1-D tensor, found {type(token_bytes).__name__}")
    except Exception as e:
        raise UserError(f"{path} is unreadable ({error_line(e)}); {TRAIN_HINT} to write it again") from None
    return token_bytes.to(device)
