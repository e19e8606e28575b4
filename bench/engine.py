"""
Decoding benchmark: the Engine (KV cache, engine.decode_step) against naive generation, on this machine.

The Engine is nanochat/engine.py's; naive generation (engine.generate_naive) re-runs the whole sequence at every step.

    python bench/engine.py                                  # depth 4, vocab 8192, context 2048, CPU, 1 and 2 threads
    python bench/engine.py --threads=2 --naive=False        # decoding as an evaluation: B = 1, 8, 32, 128
    python bench/engine.py --threads=1 --repeats=5
    python bench/engine.py --device_type=cuda --depth=20 --vocab_size=65536 --batch_sizes=1,8,32,128 --threads=0

For each thread count, prints:
- decode tokens/s of the engine at each batch size (tokens/s counts every sample's tokens: B x steps / time),
  measured from the first token to the last, i.e. the steady decoding rate; also per CPU-second of the process;
- time per output token (TPOT: one decode step, which gives every sequence its next token) and the memory-bandwidth
  utilisation: the bytes one step reads (the decode weights' matrices in the compute dtype, the B rows of the
  lookup tables, and the KV cache each sequence's attention sees, averaged over the steps) per second, against the
  bandwidth measured here at the same thread count (the best of `bandwidth_repeats` sums of a
  `bandwidth_mib` tensor, far larger than the caches). Decoding at small B is bound by this read: the
  utilisation says how close to the machine's limit it runs; at large B the arithmetic takes over;
- time to first token (TTFT): from the generate() call to the first token column, i.e. prefill of the
  prompt + the first sample, for the bench prompt and for a long prompt (`long_prompt_tokens`);
- naive generation's tokens/s for the same prompt and number of new tokens at batch 1, end to end, and the
  engine's end-to-end speedup over it (the same work: prompt in, `new_tokens` tokens out);
and the peak memory (RSS; on CUDA the GPU's) after each batch size's runs and at the end. Medians of `repeats` runs.
Also, greedy at batch 1 without the engine around it: decoding through GPT.forward with the KV cache (the generic
path), and engine.decode_step with the weight matrices as nn.Linear stores them (out, in) and with decode_weights()'
copies (on CPU stored (in, out)), to show what the lean step and the layout are each worth.
Random weights (the speed does not depend on them) and a random prompt; the tokenizer (needed for its special
tokens) is the pydocs one of `vocab_size` in $NANOCHAT_BASE_DIR (default: a private bench directory), trained if
missing, once (pydocs is too small for 65,536 tokens: it ends smaller). The engine runs under autocast in the compute
dtype (nanochat/hardware.py), as the chat scripts do: bf16 on CUDA and on a CPU with native bf16.

--compile_decode=True: the Engine's compiled step (Engine(compile_decode=True), docs/engine.md "The compiled step":
on CUDA a CUDA graph per step). Each batch size's first steps compile before the measurements (printed: "[compile]");
on CUDA the end says how many compiled graphs did not become CUDA graphs (0: all did). Its engine keeps its caches
(up to four shapes) between calls, so a batch size's peak memory includes the others' caches; its attention reads
the whole cache (rounded up to 128 positions), while the bandwidth figure counts only what a step must read.

--head=PATH (a checkout of karpathy/nanochat, 92d63d4; its commit from git, or from a COMMIT file in it): after ours,
HEAD's own GPT (its GPTConfig at this depth, its window pattern SSSL, random weights) and Engine, timed the same way
by bench/head_engine.py in a process of its own (PYTHONPATH=PATH: this process never imports HEAD's code), in our
compute dtype (NANOCHAT_DTYPE), at the batch sizes, prompt and new tokens here and the last thread count; then one
table: per batch size, time per output token, decode tokens/s, time to first token and peak memory, ours and HEAD's.
HEAD's Engine imports its tokenizer module (rustbpe, tiktoken) and filelock: a missing one is named in the error.

    python bench/engine.py --device_type=cuda --depth=20 --vocab_size=65536 --threads=0 --naive=False --head=.head
    python bench/engine.py --device_type=cuda --depth=20 --vocab_size=65536 --threads=0 --naive=False \
        --compile_decode=True

Old code against new (--compare=TREE, a checkout of the old code, e.g. `git worktree add /tmp/base-08257cc 08257cc`):
this benchmark with `repeats=1` and no naive generation, run with that tree's nanochat and with this one's, in turn,
`--rounds` times (bench/ab.py: why interleaved); prints the median decode tokens/s per batch size and thread count
and TTFT per tree, the compute dtype each chose, new / old, the CPU model, its bf16 flags and the load:

    python bench/engine.py --compare=/tmp/base-08257cc --threads=1 --rounds=5
"""

import os
import resource
import statistics
import tempfile
import time

import torch

os.environ.setdefault("NANOCHAT_BASE_DIR", os.path.join(tempfile.gettempdir(), "nanochat_bench"))
os.environ["NANOCHAT_DATASET"] = "pydocs"

from ab import machine_line  # bench/ab.py: the CPU model and its bf16 flags
from nanochat.configurator import configure
from nanochat.dataset import parquets_iter_batched
from nanochat.engine import Engine, KVCache, decode_step, decode_weights, generate_naive
from nanochat.gpt import GPT, config_from_depth, layer_windows, weights_of
from nanochat.hardware import autocast_dtype
from nanochat.output import print0
from nanochat.probes import fp32_cache_pays
from nanochat.tokenizer import Tokenizer, get_tokenizer_dir

depth = 4  # model depth (base_train's default model at this depth: qk_scale 1.2, value embeddings, the 2026 init)
window_pattern = "L"  # attention windows per layer, as base_train's --window_pattern (HEAD's default: SSSL)
vocab_size = 8192  # tokenizer / model vocabulary
sequence_len = 2048  # the model's context (Engine.context_len)
prompt_tokens = 32  # prompt length for the decode and naive measurements
long_prompt_tokens = 1024  # a second prompt length, for time to first token only
new_tokens = 256  # tokens generated per sample
batch_sizes = "1,8,32,128"  # comma-separated num_samples values for the engine
temperature = 1.0  # sampling temperature (0 = greedy)
threads = "1,2"  # comma-separated torch thread counts to measure with (0 = leave torch's default)
repeats = 3  # runs per measurement; the median is reported
naive = True  # also time naive generation (engine.generate_naive) at batch 1
device_type = "cpu"  # cpu | cuda
compare = ""  # comma-separated checkouts of other code to measure against this one, interleaved
rounds = 5  # with compare: rounds, each running every tree once
bandwidth_mib = 1024  # size of the tensor summed to measure the memory bandwidth
bandwidth_repeats = 5  # sums of it; the best is the bandwidth
compile_decode = False  # Engine(compile_decode=True): the step under torch.compile (a CUDA graph on CUDA)
head = ""  # a checkout of karpathy/nanochat (92d63d4): its Engine too, in a process of its own (bench/head_engine.py)
config = configure(globals())


def compare_trees():
    """This benchmark in every tree (its nanochat), interleaved; the summary table, then exit."""
    import re
    import sys

    from ab import interleaved, label, machine_line, median, run_in_tree, trees_to_compare  # bench/ab.py

    trees = trees_to_compare(compare)
    keep = {k: v for k, v in config.items() if k not in ("compare", "rounds", "repeats", "naive")}
    argv = [sys.executable, os.path.abspath(__file__), *(f"--{k}={v}" for k, v in keep.items()),
            "--repeats=1", "--naive=False"]
    print0(f"bench/engine.py {' '.join(argv[2:])} in each tree, {rounds} rounds\n{machine_line()}")

    def measure(tree):
        out, _ = run_in_tree(tree, argv, {"NANOCHAT_BASE_DIR": os.environ["NANOCHAT_BASE_DIR"]})
        rates = {f"{m[0]} B={m[1]}": float(m[2].replace(",", "")) for m in
                 re.findall(r"^\[(\d+ threads?)\] engine B=(\d+): decode ([\d,]+) tok/s", out, re.M)}
        ttft = {f"{m[0]} B={m[1]} TTFT": float(m[2]) for m in
                re.findall(r"^\[(\d+ threads?)\] engine B=(\d+): .*TTFT ([\d.]+) ms", out, re.M)}
        return dict(dtype=re.search(r"matmul dtype (\S+),", out)[1], **rates, **ttft)

    results = interleaved(trees, rounds, measure)
    keys = [k for k in results[trees[0]][0] if k != "dtype"]
    print0("\n| code | dtype | "
           + " | ".join(k.replace("B=", "decode B=") + (" (ms)" if "TTFT" in k else " (tok/s)") for k in keys)
           + " |")
    print0("|---" * (len(keys) + 2) + "|")
    for tree, rows in results.items():
        print0(f"| {label(tree)} | {rows[0]['dtype']} | "
               + " | ".join(f"{median(r[k] for r in rows):,.1f}" for k in keys) + " |")
    old = results[trees[0]]
    new = results[trees[-1]]
    print0("new / old: " + ", ".join(f"{k} {median(r[k] for r in new) / median(r[k] for r in old):.2f}x"
                                     for k in keys if "TTFT" not in k))
    print0(machine_line())
    sys.exit(0)


if compare:
    compare_trees()

device = torch.device(device_type)
tok_dir = get_tokenizer_dir()
tokenizer = Tokenizer.from_directory(tok_dir) if os.path.exists(os.path.join(tok_dir, "tokenizer.json")) else None
# pydocs holds too little text for a large vocabulary (65,536): the tokenizer ends smaller, and says what was asked of
# it in this file, so that the next run does not train it again. The model has vocab_size rows either way.
asked = os.path.join(tok_dir, "asked_vocab_size")
trained_for = open(asked).read().strip() if os.path.exists(asked) else None
if tokenizer is None or (tokenizer.get_vocab_size() != vocab_size and trained_for != str(vocab_size)):
    tokenizer = Tokenizer.train_from_iterator((doc for batch in parquets_iter_batched("train") for doc in batch),
                                              vocab_size)
    tokenizer.save(tok_dir)
    with open(asked, "w") as f:
        f.write(f"{vocab_size}\n")

torch.manual_seed(0)
model = GPT(config_from_depth(depth, vocab_size=vocab_size, sequence_len=sequence_len, qk_scale=1.2, value_embeds=True,
                              window_pattern=window_pattern)).to(device)
model.init_weights(recipe="2026")
with torch.no_grad():  # init_weights zeroes the output projections and the head: give them weight
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            p.normal_(std=p.size(1) ** -0.5)
model.eval()
engine = Engine(model, tokenizer, compile_decode=compile_decode)
n_special = len(tokenizer.get_special_tokens())
gen = torch.Generator().manual_seed(0)
ordinary = tokenizer.get_vocab_size() - n_special  # the prompts' ids: ordinary tokens of the tokenizer
prompt = torch.randint(0, ordinary, (prompt_tokens,), generator=gen).tolist()
long_prompt = torch.randint(0, ordinary, (long_prompt_tokens,), generator=gen).tolist()
dtype = autocast_dtype(device_type)
autocast = torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
weights_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
print0(f"device {device}, model depth {depth} ({model.num_params() / 1e6:.1f}M params, {weights_mb:.0f} MiB fp32), "
       f"vocab {vocab_size}, context {engine.context_len}, matmul dtype {dtype}, prompt {prompt_tokens} tokens, "
       f"{new_tokens} new tokens, temperature {temperature}, median of {repeats}, "
       f"decode step {'compiled' if compile_decode else 'eager'}")


def memory_bandwidth():
    """Bytes read per second: the best of `bandwidth_repeats` sums of a `bandwidth_mib` MiB fp32 tensor."""
    x = torch.ones(bandwidth_mib * 2**18, device=device)
    best = float("inf")
    for _ in range(bandwidth_repeats):
        sync()
        t0 = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t0)
    del x
    return bandwidth_mib * 2**20 / best


def step_bytes(B, steps):
    """
    Bytes one decode step reads at batch B, averaged over `steps` steps after the prompt: the matrices (in the
    compute dtype, as Engine's decode weights hold them), B rows of each lookup table, and per layer the keys and
    values each sequence's attention sees (its window, if the layer has one) in the cache's dtype.
    """
    cfg = model.config
    size = torch.tensor([], dtype=dtype).element_size()
    cache_size = 4 if device.type == "cpu" and dtype == torch.bfloat16 and fp32_cache_pays() else size
    weights = weights_of(model)
    matrices = [weights.lm_head] + [m for layer in weights.layers for m in layer[:5] if m is not None]  # to ve_gate
    tables = 1 + sum(layer.ve_table is not None for layer in weights.layers)
    fixed = sum(m.numel() for m in matrices) * size + tables * B * cfg.n_embd * size
    head_dim = cfg.n_embd // cfg.n_head
    seen = [sum(min(p + 1, w + 1) if w else p + 1 for w in layer_windows(cfg))
            for p in range(prompt_tokens, prompt_tokens + steps)]
    return fixed + 2 * B * cfg.n_kv_head * head_dim * cache_size * statistics.mean(seen)


def peak_rss_mib():
    """The peak RSS since reset_peak_rss() (Linux's VmHWM), else of the whole process."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # in kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_rss():
    """Start the peak RSS again from the current RSS (Linux: 5 into clear_refs), so each batch size has its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def run_engine(tokens, num_samples, max_tokens, seed):
    """
    (seconds to the first column, seconds from the first column to the last, number of steps, CPU seconds this
    process used from the first column to the last).
    """
    sync()
    t0 = time.perf_counter()
    with autocast:
        steps = engine.generate(tokens, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature,
                                seed=seed)
        next(steps)
        t1 = time.perf_counter()
        cpu1 = time.process_time()
        n = 1 + sum(1 for _ in steps)
    sync()
    return t1 - t0, time.perf_counter() - t1, n, time.process_time() - cpu1


def run_naive(seed):
    sync()
    t0 = time.perf_counter()
    with autocast:
        n = sum(1 for _ in generate_naive(model, prompt, new_tokens, temperature=temperature, seed=seed))
    sync()
    return time.perf_counter() - t0, n


@torch.inference_mode()
def decode_step_rate(weights, steps=128):
    """
    engine.decode_step alone at batch 1 (greedy, no engine around it): tokens/s. weights=None: decode through
    GPT.forward with the KV cache instead (the generic cached path: nn.Modules, one (1, 1) token sequence).
    """
    cfg = model.config
    cache = KVCache(1, cfg.n_kv_head, prompt_tokens + steps, cfg.n_embd // cfg.n_head, cfg.n_layer, device,
                    model.lm_head.weight.dtype)
    token = model.prefill(torch.tensor([prompt], device=device), cache).argmax(-1)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        if weights is None:
            token = model(token[:, None], kv_cache=cache)[:, -1].argmax(-1)
        else:
            token = decode_step(model, token, cache, weights).argmax(-1)
        token.tolist()  # as the engine does
    sync()
    return steps / (time.perf_counter() - t0)


as_stored = weights_of(model)  # the parameters themselves, (out, in) as nn.Linear stores them
Bs = [int(b) for b in batch_sizes.split(",")]
layout_check = device.type == "cpu" and dtype == torch.float32  # decode_weights() copies only on CPU
if layout_check:
    with torch.inference_mode():
        copies = decode_weights(model)
rows = []
all_peaks = []
for n_threads in [int(t) for t in threads.split(",")]:
    if n_threads > 0:
        torch.set_num_threads(n_threads)
    label = f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"
    if not compile_decode:  # warm-up (compiled: the loop below, at the shapes measured, not one more to compile)
        run_engine(prompt, 1, 8, seed=0)
    else:  # compile (and record the CUDA graph of) each batch size's step at the cache size measured
        for B in Bs:
            t0 = time.perf_counter()
            with autocast:
                for _, _ in zip(range(4), engine.generate(prompt, B, max_tokens=new_tokens, temperature=temperature)):
                    pass
            sync()
            print0(f"[compile] B={B}: the first 4 steps (compiling a shape not seen yet) took "
                   f"{time.perf_counter() - t0:.1f} s")
    bandwidth = memory_bandwidth()
    print0(f"[{label}] memory bandwidth (best sum of a {bandwidth_mib} MiB tensor): {bandwidth / 1e9:.1f} GB/s")
    runs = {B: [] for B in Bs}
    peaks = {}
    layout = []
    long_ttfts = []
    pairs = []
    # one round of every measurement per repeat, so that all of them see the same mix of load on a shared machine
    for r in range(repeats):
        for B in Bs:
            reset_peak_rss()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            runs[B].append(run_engine(prompt, B, new_tokens, seed=r))
            gpu = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mib()
            peaks[B] = max(peaks.get(B, 0), gpu)
            all_peaks.append(gpu)
        if layout_check:
            layout.append((decode_step_rate(None), decode_step_rate(as_stored), decode_step_rate(copies)))
        long_ttfts.append(run_engine(long_prompt, 1, 1, seed=r)[0])
        if naive:  # the engine end to end and naive generation back to back: the same work, the same load
            t, dt, n, _ = run_engine(prompt, 1, new_tokens, seed=r)
            naive_dt, naive_n = run_naive(seed=r)
            pairs.append((n / (t + dt), naive_n / naive_dt))
    decode = {B: statistics.median((n - 1) * B / dt for _, dt, n, _ in runs[B]) for B in Bs}
    # tokens per CPU-second of this process: on a busy machine, closer than wall time to what an idle one gives
    # (it leaves out the time other programs held the cores, not the memory bandwidth they took); with several
    # threads it counts every thread's time, so it is comparable only at 1 thread
    decode_cpu = {B: statistics.median((n - 1) * B / cpu for _, _, n, cpu in runs[B]) for B in Bs}
    ttft = {B: statistics.median(t for t, _, _, _ in runs[B]) for B in Bs}
    util = {}
    for B in Bs:
        if any(n != new_tokens for _, _, n, _ in runs[B]):
            print0(f"  note: at B={B} some runs ended early (every sample ended): "
                   f"steps {[n for _, _, n, _ in runs[B]]}")
        steps = statistics.median(n - 1 for _, _, n, _ in runs[B])
        read = step_bytes(B, int(steps)) * decode[B] / B  # bytes per step x steps per second
        memory = f"peak {'GPU memory' if device.type == 'cuda' else 'RSS'} {peaks[B]:.0f} MiB"
        print0(f"[{label}] engine B={B}: decode {decode[B]:,.0f} tok/s ({decode_cpu[B]:,.0f} tok/s per CPU-second), "
               f"TPOT {1000 * B / decode[B]:.2f} ms, reads {read / 1e9:.1f} GB/s = {100 * read / bandwidth:.0f}% of "
               f"the bandwidth, {memory}, TTFT {1000 * ttft[B]:.1f} ms  "
               f"(runs: {', '.join(f'{(n - 1) * B / dt:,.0f}' for _, dt, n, _ in runs[B])} tok/s)")
        util[B] = read / bandwidth
    if layout_check:
        print0(f"[{label}] greedy B=1 without the engine: GPT.forward with the cache "
               f"{statistics.median(f for f, _, _ in layout):,.0f} tok/s; decode_step with the weights (out, in) as "
               f"stored {statistics.median(a for _, a, _ in layout):,.0f} tok/s, "
               f"with decode_weights() copies (in, out) {statistics.median(b for _, _, b in layout):,.0f} tok/s "
               f"(runs: {', '.join(f'{f:,.0f}/{a:,.0f}/{b:,.0f}' for f, a, b in layout)})")
    long_ttft = statistics.median(long_ttfts)
    print0(f"[{label}] TTFT with a {long_prompt_tokens}-token prompt: {1000 * long_ttft:.0f} ms "
           f"(runs: {', '.join(f'{1000 * t:.0f}' for t in long_ttfts)} ms)")
    e2e = naive_rate = speedup = None
    if naive:
        e2e = statistics.median(e for e, _ in pairs)
        naive_rate = statistics.median(nv for _, nv in pairs)
        speedup = statistics.median(e / nv for e, nv in pairs)
        print0(f"[{label}] B=1 end to end: engine {e2e:,.0f} tok/s, naive {naive_rate:,.1f} tok/s, "
               f"speedup {speedup:.1f}x (runs: {', '.join(f'{e:,.0f}/{nv:,.1f}' for e, nv in pairs)})")
    rows.append((label, decode, decode_cpu, ttft, long_ttft, e2e, naive_rate, speedup, util, bandwidth))
    ours = dict(label=label, threads=torch.get_num_threads(), decode=decode, ttft=ttft, peaks=peaks)

print0(f"\npeak {'GPU memory' if device.type == 'cuda' else 'RSS'} of the runs: {max(all_peaks):.0f} MiB\n")
print0("| threads | " + " | ".join(f"B={B}: decode (per CPU-s) / TPOT / bandwidth used / TTFT" for B in Bs)
       + f" | TTFT, {long_prompt_tokens}-token prompt | B=1 end to end: engine | naive | speedup |")
print0("|---" * (len(Bs) + 5) + "|")
for label, decode, decode_cpu, ttft, long_ttft, e2e, naive_rate, speedup, util, bandwidth in rows:
    naive_cells = f"{e2e:,.0f} tok/s | {naive_rate:,.1f} tok/s | {speedup:.1f}x" if naive else "- | - | -"
    print0(f"| {label} | " + " | ".join(f"{decode[B]:,.0f} tok/s ({decode_cpu[B]:,.0f}) / {1000 * B / decode[B]:.2f} "
                                        f"ms / {100 * util[B]:.0f}% of {bandwidth / 1e9:.1f} GB/s / "
                                        f"{1000 * ttft[B]:.1f} ms" for B in Bs)
           + f" | {1000 * long_ttft:.0f} ms | {naive_cells} |")
if compile_decode and device.type == "cuda":  # a graph that did not become a CUDA graph ran as compiled kernels
    skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
    print0(f"compiled decode: {skips} compiled graph(s) not run as CUDA graphs (0: every step a CUDA graph)")
print0(machine_line())


def head_commit(path):
    """The commit of HEAD's checkout: `git rev-parse` in it, else the COMMIT file an archive was given, else unknown."""
    import subprocess
    if os.path.exists(os.path.join(path, ".git")):
        git = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if git.returncode == 0:
            return git.stdout.strip()
    commit_file = os.path.join(path, "COMMIT")
    return open(commit_file).read().strip() if os.path.exists(commit_file) else "unknown commit"


def run_head():
    """HEAD's Engine in a process of its own (bench/head_engine.py), then one table of its figures beside ours."""
    import json
    import subprocess
    import sys
    path = os.path.abspath(head)
    if not os.path.exists(os.path.join(path, "nanochat", "engine.py")):
        print0(f"error: --head={head} is not a checkout of karpathy/nanochat (no nanochat/engine.py in it)")
        sys.exit(1)
    commit = head_commit(path)
    if device.type == "cuda":  # our caches out of the card's way (HEAD's peak is its own process's)
        torch.cuda.empty_cache()
    argv = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "head_engine.py"),
            f"--depth={depth}", f"--vocab_size={vocab_size}", f"--sequence_len={sequence_len}",
            f"--prompt_tokens={prompt_tokens}", f"--new_tokens={new_tokens}", f"--batch_sizes={batch_sizes}",
            f"--temperature={temperature}", f"--repeats={repeats}", f"--device_type={device_type}",
            f"--threads={ours['threads']}"]
    # HEAD's nanochat alone on the path, its compute dtype ours
    env = dict(os.environ, PYTHONPATH=path, NANOCHAT_DTYPE=str(dtype).replace("torch.", ""))
    env.setdefault("HF_HUB_OFFLINE", "1")  # its FA3 from the hub's cache or not at all: no waiting on a network
    print0(f"\nHEAD (karpathy/nanochat {commit}): bench/head_engine.py {' '.join(argv[2:])}")
    result = subprocess.run(argv, cwd=path, env=env, capture_output=True, text=True)
    lines = result.stdout.rstrip().splitlines()
    print0("\n".join(lines if result.returncode != 0 else lines[:-1]))  # its last line: the JSON read below
    if result.returncode != 0:
        missing = [line for line in result.stderr.splitlines() if "ModuleNotFoundError" in line]
        hint = f" ({missing[-1]}: HEAD's imports need it, see bench/head_speed.py's docstring)" if missing else ""
        print0(f"error: HEAD's Engine failed{hint}:\n{result.stderr[-3000:]}")
        sys.exit(1)
    theirs = json.loads(result.stdout.splitlines()[-1])
    cells = {r["batch_size"]: r for r in theirs["rows"]}
    memory = "peak GPU memory" if device.type == "cuda" else "peak RSS"
    print0(f"\n| engine, {ours['label']} | " + " | ".join(f"B={B}: TPOT / tok/s / TTFT / {memory}" for B in Bs) + " |")
    print0("|---" * (len(Bs) + 1) + "|")
    print0(f"| ours ({'compiled' if compile_decode else 'eager'} step, {str(dtype).replace('torch.', '')}) | "
           + " | ".join(f"{1000 * B / ours['decode'][B]:.2f} ms / {ours['decode'][B]:,.0f} / "
                        f"{1000 * ours['ttft'][B]:.1f} ms / {ours['peaks'][B]:.0f} MiB" for B in Bs) + " |")
    print0(f"| HEAD {commit} ({theirs['dtype'].split(' ')[0]}, window pattern {theirs['config']['window_pattern']}, "
           f"{theirs['attention']}) | "
           + " | ".join(f"{cells[B]['tpot_ms']:.2f} ms / {cells[B]['decode_tok_per_sec']:,.0f} / "
                        f"{cells[B]['ttft_ms']:.1f} ms / {cells[B]['peak_memory_mib']:.0f} MiB" for B in Bs) + " |")
    print0(f"HEAD = karpathy/nanochat {commit}: its own GPT ({theirs['params'] / 1e6:.1f}M params, "
           f"{theirs['config']['n_embd']} wide) and Engine, random weights, in a process of its own; ours "
           f"{model.num_params() / 1e6:.1f}M params; tok/s: decode tokens/s over all rows")


if head:
    run_head()
