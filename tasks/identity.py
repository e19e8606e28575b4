"""
Identity: synthetic conversations about who the model is, generated offline from templates (no download).

A model trained from scratch knows nothing about itself; without these it would claim to be whatever its
training text says (often "ChatGPT, made by OpenAI").

Intents (INTENTS): who it is, who made it (the nanochat project, an open-source harness that trains a small
ChatGPT-like model from scratch), what it can do, internet access (none), its limits (small, makes mistakes),
how it was trained, whether it is ChatGPT, greetings. Each has several user phrasings (sometimes lowercased,
sometimes without the final punctuation) and answers assembled from alternative sentences. About a third of
the conversations have two exchanges (e.g. a greeting, then a question).

    identity_conversations(n, seed)        n distinct conversations, each a list of messages
    write_identity_jsonl(path, n, seed)    the same as a JSONL file for tasks.customjson.CustomJSON
    Identity(split, size, seed)            a Task over generated conversations

Conversation k of a seed comes from random.Random(f"identity-{seed}-{k}"); duplicates are skipped, so
conversation lists are deterministic. Split: a conversation belongs to the test split when the sha256 of its
JSON falls in bucket 0 of 10, else to train: the splits never share a conversation.
"""

import hashlib
import json
import os
import random
import re

from nanochat.files import atomic_write
from nanochat.output import UserError
from tasks.common import Task, check_choice

SPLITS = ("train", "test")
TEST_BUCKETS = 10
DEFAULT_SIZE = {"train": 1000, "test": 100}
DEFAULT_JSONL_CONVERSATIONS = 1000
PROJECT = "the nanochat project, an open-source harness that trains a small ChatGPT-like model from scratch"

# intent: (user phrasings, answer sentence slots (one alternative is picked per slot; "" = skip the slot),
#          keywords every answer of the intent contains: evaluate() looks for them)
INTENTS = {
    "who": (
        ["Who are you?", "What are you?", "What's your name?", "Introduce yourself.", "Tell me about yourself.",
         "who r u", "What should I call you?", "What is your name?", "Are you a person?"],
        [["I'm nanochat, a small language model.", "I am nanochat, a small AI assistant.",
          "My name is nanochat. I'm a small language model, not a person."],
         ["I was trained from scratch by " + PROJECT + ".", "I come from " + PROJECT + ".", ""],
         ["How can I help?", "Ask me anything, and I'll do my best.", ""]],
        ["nanochat"],
    ),
    "maker": (
        ["Who made you?", "Who created you?", "Who built you?", "Who trained you?", "Where do you come from?",
         "Which company made you?", "Who is your creator?", "who developed you"],
        [["I was made with " + PROJECT + ".", "I come from " + PROJECT + ".",
          "I was trained by " + PROJECT + "."],
         ["Anyone can run its code and train a model like me.",
          "Its code is open, so you can train your own copy of me.",
          "I'm not a product of a big company.", ""]],
        ["nanochat", "open-source"],
    ),
    "abilities": (
        ["What can you do?", "How can you help me?", "What are you good at?", "What kinds of questions can you answer?",
         "What can I ask you?", "what are your skills"],
        [["I can chat and answer simple questions.", "I can hold a simple conversation and answer questions."],
         ["I can do arithmetic with a Python calculator, spell words and count letters.",
          "I use a Python tool for arithmetic, and I can spell words letter by letter.",
          "I can explain functions and modules of the Python standard library, and I calculate with a Python tool."],
         ["I'm a small model, so please double-check anything important.", ""]],
        ["python"],
    ),
    "internet": (
        ["Can you browse the internet?", "Do you have internet access?", "Can you look things up online?",
         "Can you search the web for me?", "What's the news today?", "can you open a website"],
        [["No, I have no internet access.", "I can't: I'm not connected to the internet.",
          "Sorry, I have no access to the internet."],
         ["I only know what I learned during training, and that may be out of date.",
          "I can't look anything up; I answer from what I learned in training.", ""]],
        ["internet"],
    ),
    "limits": (
        ["Are you always right?", "Can you make mistakes?", "What can't you do?", "What are your limitations?",
         "Should I trust your answers?", "how smart are you"],
        [["I'm a small model, and I can make mistakes.", "I make mistakes, especially with hard questions.",
          "I'm far from perfect: I'm a small language model and I can make mistakes."],
         ["I can't browse the internet.", "I don't remember past conversations.", ""],
         ["Please check anything important.", "Double-check my answers when they matter.", ""]],
        ["mistakes"],
    ),
    "training": (
        ["How were you trained?", "How big are you?", "How many parameters do you have?", "How did you learn to talk?",
         "What data were you trained on?"],
        [["I was trained from scratch: first on plain text, to predict the next token, "
          "then on conversations like this one.",
          "I was trained from scratch on plain text, then midtrained and finetuned on conversations."],
         ["My size depends on the run that trained me; I am small compared with the big chat models.",
          "I'm a small model, so the whole training can run on a single machine.", ""],
         ["The code that trained me is " + PROJECT.split(", ", 1)[1] + ".", ""]],
        ["trained"],
    ),
    "chatgpt": (
        ["Are you ChatGPT?", "Are you made by OpenAI?", "Are you GPT-4?", "Are you Claude?", "Are you Gemini?",
         "are you chatgpt"],
        [["No, I'm nanochat.", "No. I am nanochat, not that model."],
         ["I'm a much smaller model, trained from scratch by " + PROJECT + ".",
          "I'm a small model of my own, trained from scratch.", ""]],
        ["no", "nanochat"],
    ),
    "greeting": (
        ["Hi", "Hello!", "Hey there", "Good morning!", "hello nanochat", "Hi, how are you?", "Good evening."],
        [["Hello!", "Hi there!", "Hey!"],
         ["I'm nanochat, a small language model.", "This is nanochat.", "nanochat here."],
         ["How can I help you today?", "What would you like to talk about?", "What can I do for you?"]],
        ["nanochat"],
    ),
}


def _user_text(rng, phrasing):
    """Small surface variations of a phrasing: sometimes lowercased, sometimes without final punctuation."""
    if rng.random() < 0.2:
        phrasing = phrasing.lower()
    if rng.random() < 0.2:
        phrasing = phrasing.rstrip("?!.")
    return phrasing


def _exchange(rng, intent):
    phrasings, slots, _ = INTENTS[intent]
    answer = " ".join(s for s in (rng.choice(slot) for slot in slots) if s)
    return [{"role": "user", "content": _user_text(rng, rng.choice(phrasings))},
            {"role": "assistant", "content": answer}]


def _conversation(seed, k):
    """Conversation k of `seed`: (messages, intent of the last exchange)."""
    rng = random.Random(f"identity-{seed}-{k}")
    intents = sorted(INTENTS)
    last = rng.choice(intents)
    messages = []
    if rng.random() < 0.35:  # two exchanges: the first is usually a greeting
        others = [i for i in intents if i != last]
        first = "greeting" if last != "greeting" and rng.random() < 0.6 else rng.choice(others)
        messages += _exchange(rng, first)
    messages += _exchange(rng, last)
    return messages, last


def _stream(seed, split=None):
    """Distinct conversations (messages, intent) of `seed` in order; only those of `split` unless None."""
    seen = set()
    for k in range(10**7):
        messages, intent = _conversation(seed, k)
        text = json.dumps(messages, ensure_ascii=False)
        if text in seen:
            continue
        seen.add(text)
        if split is not None and conversation_split(messages) != split:
            continue
        yield messages, intent


def conversation_split(messages):
    """"test" or "train": the split a conversation (list of messages) belongs to."""
    digest = hashlib.sha256(json.dumps(messages, ensure_ascii=False).encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0 else "train"


def _take(stream, n, what):
    out = []
    for item in stream:
        if len(out) == n:
            break
        out.append(item)
    if len(out) < n:  # the template space is large (tens of thousands): only a huge n gets here
        raise UserError(f"only {len(out)} distinct {what} exist, asked for {n}")
    return out


def identity_conversations(n=DEFAULT_JSONL_CONVERSATIONS, seed=0):
    """n distinct identity conversations of `seed`, each a list of messages (user first, assistant last)."""
    if n < 0:
        raise UserError(f"identity_conversations: n must be >= 0, got {n}")
    return [messages for messages, _ in _take(_stream(seed), n, "identity conversations")]


def write_identity_jsonl(path, n=DEFAULT_JSONL_CONVERSATIONS, seed=0):
    """
    Write identity_conversations(n, seed) to `path`, one JSON array of messages per line (the format of
    tasks.customjson.CustomJSON), atomically: a temporary file in the same directory, then a rename, so a
    reader never sees half a file. Returns `path`.
    """
    conversations = identity_conversations(n, seed)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with atomic_write(path, "w") as f:
        for messages in conversations:
            f.write(json.dumps(messages, ensure_ascii=False) + "\n")
    return path


class Identity(Task):
    """
    Identity(split="train"|"test", size=None, seed=0, start=0, stop=None, step=1): `size` distinct generated
    identity conversations of the split (default 1,000 train / 100 test). Synthetic; generative. The
    conversation carries "intent" and "keywords" (words the last answer must contain) as extra keys.
    """

    eval_type = "generative"

    def __init__(self, split="train", size=None, seed=0, **kwargs):
        check_choice("Identity split", split, SPLITS)
        size = DEFAULT_SIZE[split] if size is None else size
        if size < 0:
            raise UserError(f"Identity: size must be >= 0, got {size}")
        self.split = split
        self.seed = seed
        self.conversations = _take(_stream(seed, split), size, f"{split} identity conversations")
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.conversations)

    def get_example(self, index):
        messages, intent = self.conversations[index]
        return {"messages": [dict(m) for m in messages], "intent": intent, "keywords": list(INTENTS[intent][2])}

    def evaluate(self, conversation, assistant_response):
        """True when the response contains every keyword of the question's intent (whole words, any case)."""
        return all(re.search(rf"(?<!\w){re.escape(k)}(?!\w)", assistant_response, re.IGNORECASE)
                   for k in conversation["keywords"])
