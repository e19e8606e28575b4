"""
Chat with a trained model in the terminal.

The reply is printed as it is generated, and the conversation is kept from turn to turn (the model sees all of
it) until you start over.

    python -m scripts.chat_cli                              # the SFT model (the one finetuned to chat)
    python -m scripts.chat_cli --source=mid                 # the midtrained model (or rl, or base)
    python -m scripts.chat_cli -p "Why is the sky blue?"    # answer once and exit: only the reply goes to stdout

At the prompt: `clear` starts a new conversation, `quit` (or Ctrl-D) exits, and Ctrl-C stops the reply being
generated without leaving (what was said so far stays in the conversation).

The context: each turn, the whole conversation plus the reply must fit in the length the model was trained
on (its context, Engine.context_len). When the conversation grows too long, the oldest exchanges are dropped
(it says so); a single message too long for the context is refused. After each reply, [context: used/total]
shows how full it is.
"""

import contextlib
import io
import random
import signal
import sys

from nanochat.checkpoint_manager import load_model
from nanochat.configurator import check_config, configure
from nanochat.engine import Engine, TextStreamer
from nanochat.hardware import autocast_context, compute_dtype_line
from nanochat.output import UserError, setup_default_logging
from nanochat.processes import autodetect_device_type, compute_init


def prompt_flag_to_key(argv):
    """`-p TEXT` and `--prompt TEXT` -> `--prompt=TEXT`: the configurator takes only --key=value."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("-p", "--prompt"):
            if i + 1 == len(argv):
                raise UserError(f'{argv[i]} needs the prompt after it, e.g. -p "Why is the sky blue?"')
            out.append("--prompt=" + argv[i + 1])
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


# -----------------------------------------------------------------------------
# Config (override as --key=value; --help lists them)
source = "sft"  # which stage's model: base | mid | sft | rl
model_tag = ""  # which model of that stage (needed only if there are several)
step = -1  # which checkpoint step (-1 = the last)
device_type = ""  # cuda | cpu | mps; empty = autodetect
temperature = 0.6  # sampling temperature (0 = greedy: always the most likely token)
top_k = 50  # sample from the k most likely tokens (0 = the whole vocabulary)
max_tokens = 512  # longest reply, in tokens (the room left in the context may stop it sooner)
seed = -1  # sampling seed of every reply (-1 = a new random seed for each reply)
prompt = ""  # answer this prompt and exit, like -p "..." (empty = interactive chat)
setup_default_logging()  # from here on a UserError prints one line, not a traceback
sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character shows "?", not a crash
_argv = prompt_flag_to_key(sys.argv[1:])
# The status lines of the set-up (config overrides, the device, "Loaded ...") are held back, then go to stderr:
# stdout carries only the chat, so `-p` output can be piped, and a set-up that fails (no checkpoint) says
# so in its one error line alone. --help stays on stdout.
_status = io.StringIO()
with contextlib.redirect_stdout(sys.stdout if {"-h", "--help"} & set(_argv) else _status):
    config = configure(globals(), _argv)
    check_config(config, positive=["max_tokens"], non_negative=["temperature", "top_k"],
                 choices={"source": ("base", "mid", "sft", "rl"), "device_type": ("", "cuda", "cpu", "mps")})
    device_type = device_type or autodetect_device_type()
    _, _, _, _, device = compute_init(device_type)
    print(compute_dtype_line(device_type))
    model, tokenizer, meta = load_model(source, device, phase="eval", model_tag=model_tag or None, step=step)
sys.stderr.write(_status.getvalue())
engine = Engine(model, tokenizer)


def fit_to_context(messages):
    """
    Drop the oldest exchanges (a user message and its reply) until the conversation leaves room for a reply of
    min(max_tokens, half the context) tokens, or only the last message is left. Returns (messages kept, their
    prompt tokens, the reply's token budget, how many exchanges were dropped). A budget < 1 means the last
    message alone fills the context.
    """
    wanted = min(max_tokens, engine.context_len // 2)
    dropped = 0
    while True:
        prompt_ids = tokenizer.render_for_completion({"messages": messages})
        room = engine.context_len - len(prompt_ids)
        if room >= wanted or len(messages) == 1:
            return messages, prompt_ids, min(max_tokens, room), dropped
        messages, dropped = messages[2:], dropped + 1


def stream_reply(prompt_ids, budget):
    """
    Generate the reply, printing it as it comes; Ctrl-C stops it at the next token (a second Ctrl-C quits). Returns
    (its text, tokens generated). Ctrl-C's handler only records the press: a KeyboardInterrupt raised at any bytecode
    could land inside a print or the streamer's half-decoded bytes.
    """
    streamer = TextStreamer(tokenizer)
    pieces = []
    n_tokens = 0
    pressed = []  # Ctrl-C presses, recorded by on_ctrl_c
    reply_seed = seed if seed >= 0 else random.randrange(2**31)
    generation = engine.generate(prompt_ids, max_tokens=budget, temperature=temperature, top_k=top_k, seed=reply_seed)
    _, autocast = autocast_context(device_type)  # the compute dtype: decided by what the device does

    def on_ctrl_c(signum, frame):
        pressed.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second press: KeyboardInterrupt, the program ends

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        with autocast:  # around the whole iteration: each step runs inside the loop
            for token_column, _ in generation:
                if pressed:
                    print(" [stopped]", end="", flush=True)
                    break
                token = token_column[0]
                n_tokens += 1
                if token in engine.end_tokens:  # the model ended its turn
                    break
                pieces.append(streamer.put(token))
                print(pieces[-1], end="", flush=True)
    finally:
        signal.signal(signal.SIGINT, previous)
        generation.close()  # nothing more is computed
    pieces.append(streamer.end())
    print(pieces[-1], flush=True)
    return "".join(pieces), n_tokens


# -----------------------------------------------------------------------------
# One prompt, one answer

if prompt:
    _, prompt_ids, budget, _ = fit_to_context([{"role": "user", "content": prompt}])
    if budget < 1:
        raise UserError(f"the prompt is {len(prompt_ids):,} tokens "
                        f"and the model's context holds {engine.context_len:,}: shorten it")
    stream_reply(prompt_ids, budget)
    sys.exit(0)

# -----------------------------------------------------------------------------
# The interactive chat

try:
    import readline  # noqa: F401  (line editing and history at the prompt, where available)
except ImportError:
    pass

print(f"nanochat: the {source} model {meta['model_tag']} (step {meta['step']}) on {device}, "
      f"context {engine.context_len:,} tokens.")
print("Type a message. `clear` starts a new conversation, `quit` or Ctrl-D exits, Ctrl-C stops a reply.")
conversation = []
while True:
    try:
        text = input("\nUser: ").strip()
    except EOFError:  # Ctrl-D, or the end of piped input
        print()
        break
    except KeyboardInterrupt:
        print("\n(Ctrl-C stops a reply; type quit or press Ctrl-D to exit)")
        continue
    if text in ("quit", "exit"):
        break
    if text == "clear":
        conversation = []
        print("(new conversation)")
        continue
    if not text:
        continue
    kept, prompt_ids, budget, dropped = fit_to_context(conversation + [{"role": "user", "content": text}])
    if budget < 1:
        print(f"(your message is too long: with it the conversation is {len(prompt_ids):,} tokens "
              f"and the model's context holds {engine.context_len:,}; shorten it)")
        continue
    if dropped:
        print(f"(the conversation no longer fits in the model's context of {engine.context_len:,} tokens: dropped the "
              f"oldest {dropped} exchange{'s' if dropped > 1 else ''}; `clear` starts over)")
    print("\nAssistant: ", end="", flush=True)
    reply, n_tokens = stream_reply(prompt_ids, budget)
    conversation = kept + [{"role": "assistant", "content": reply}]
    note = " - the reply reached the end of the context" if n_tokens == budget < max_tokens else ""
    print(f"[context: {len(prompt_ids) + n_tokens:,}/{engine.context_len:,} tokens{note}]")
