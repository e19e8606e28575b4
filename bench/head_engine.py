"""
karpathy/nanochat HEAD's Engine timed as bench/engine.py times ours: run by bench/engine.py --head=PATH, in a process
of its own with PYTHONPATH=PATH, so `nanochat` here is HEAD's package (this file imports nothing of ours).

HEAD's GPT is built from its own GPTConfig at the depth asked, as its scripts/base_train.py builds it (width 64 x
depth rounded up to 128-wide heads, kv heads = heads, its window pattern), on the meta device, then to_empty and its
own init_weights (random weights, as ours: the speed does not depend on them; its zero-initialised output projections
and near-zero head are given weight, as bench/engine.py does to ours, so that sampling is not uniform). Its Engine
needs a tokenizer only for its special tokens (and the calculator, which random weights never reach): a stand-in
gives the last ids of the vocabulary to them: no trained tokenizer.pkl is needed (HEAD's modules still import
rustbpe, tiktoken and filelock).
Its compute dtype is NANOCHAT_DTYPE (bench/engine.py sets it to ours). Per batch size: a warm-up generation of 8
tokens, then `repeats` generations; time to first token (the generate call to its first column: prefill + first
sample), decode tokens/s from the first column to the last (B x (columns - 1) / that time), time per output token
(B / that rate), peak memory (CUDA: max_memory_allocated; CPU: the process's peak RSS, reset per batch size):
medians. The last line of stdout is one JSON document: {"attention", "dtype", "config", "params", "rows": [...]}:
"attention" says whether HEAD's Flash Attention 3 loaded (from the Hugging Face hub, through the `kernels` package)
or it fell back to SDPA, as it does offline (bench/engine.py sets HF_HUB_OFFLINE=1 unless told otherwise).

    PYTHONPATH=/path/to/karpathy-nanochat python bench/head_engine.py --depth=20 --device_type=cuda
"""

import argparse
import json
import statistics
import time

import torch
from nanochat.common import COMPUTE_DTYPE, COMPUTE_DTYPE_REASON
from nanochat.engine import Engine
from nanochat.flash_attention import USE_FA3
from nanochat.gpt import GPT, GPTConfig

parser = argparse.ArgumentParser(description="HEAD's Engine, timed as bench/engine.py times ours")
parser.add_argument("--depth", type=int, default=4)
parser.add_argument("--vocab_size", type=int, default=8192)
parser.add_argument("--sequence_len", type=int, default=2048)
parser.add_argument("--prompt_tokens", type=int, default=32)
parser.add_argument("--new_tokens", type=int, default=256)
parser.add_argument("--batch_sizes", type=str, default="1,8,32,128")
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--device_type", type=str, default="cpu")
parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
parser.add_argument("--window_pattern", type=str, default="SSSL", help="HEAD's default and speedrun setting")
args = parser.parse_args()
if args.threads > 0:
    torch.set_num_threads(args.threads)
device = torch.device(args.device_type)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


class SpecialTokens:
    """What HEAD's Engine asks of a tokenizer while sampling: the ids of its special tokens, the last of the vocab."""

    NAMES = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
             "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]

    def encode_special(self, name):
        return args.vocab_size - len(self.NAMES) + self.NAMES.index(name)

    def get_bos_token_id(self):
        return self.encode_special("<|bos|>")


# as HEAD's scripts/base_train.py builds its model (aspect ratio 64, head dim 128)
model_dim = -(-args.depth * 64 // 128) * 128
config = GPTConfig(sequence_len=args.sequence_len, vocab_size=args.vocab_size, n_layer=args.depth,
                   n_head=model_dim // 128, n_kv_head=model_dim // 128, n_embd=model_dim,
                   window_pattern=args.window_pattern)
with torch.device("meta"):
    model = GPT(config)
model.to_empty(device=device)
torch.manual_seed(0)
model.init_weights()
with torch.no_grad():  # its zeroed output projections and near-zero head given weight, as bench/engine.py does ours
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            p.normal_(std=p.size(1) ** -0.5)
model.eval()
engine = Engine(model, SpecialTokens())
gen = torch.Generator().manual_seed(0)
prompt = torch.randint(0, args.vocab_size - len(SpecialTokens.NAMES), (args.prompt_tokens,), generator=gen).tolist()


def peak_memory_mib():
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def reset_peak_memory():
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:  # Linux: the peak RSS starts again from the current RSS
        f.write("5")


def run(num_samples, max_tokens, seed):
    """(seconds to the first column, seconds from the first column to the last, number of columns)."""
    sync()
    t0 = time.perf_counter()
    steps = engine.generate(prompt, num_samples=num_samples, max_tokens=max_tokens, temperature=args.temperature,
                            seed=seed)
    next(steps)
    t1 = time.perf_counter()
    n = 1 + sum(1 for _ in steps)
    sync()
    return t1 - t0, time.perf_counter() - t1, n


rows = []
for B in [int(b) for b in args.batch_sizes.split(",")]:
    run(B, 8, seed=0)  # warm-up
    reset_peak_memory()
    runs = [run(B, args.new_tokens, seed=r) for r in range(args.repeats)]
    decode = statistics.median((n - 1) * B / dt for _, dt, n in runs)
    rows.append(dict(batch_size=B, decode_tok_per_sec=decode, tpot_ms=1000 * B / decode,
                     ttft_ms=1000 * statistics.median(t for t, _, _ in runs), peak_memory_mib=peak_memory_mib(),
                     steps=[n for _, _, n in runs]))
    print(f"HEAD engine B={B}: decode {decode:,.0f} tok/s, TPOT {1000 * B / decode:.2f} ms, "
          f"TTFT {rows[-1]['ttft_ms']:.1f} ms, peak memory {rows[-1]['peak_memory_mib']:.0f} MiB", flush=True)
dtype = f"{str(COMPUTE_DTYPE).replace('torch.', '')} ({COMPUTE_DTYPE_REASON})"
print(json.dumps(dict(attention="FA3" if USE_FA3 else "SDPA fallback", dtype=dtype, config=config.__dict__,
                      params=sum(p.numel() for p in model.parameters()), rows=rows)))
