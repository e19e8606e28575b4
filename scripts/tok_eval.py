"""
Evaluate the trained tokenizer: its compression ratio, next to GPT-2's and GPT-4's when tiktoken can load them.

The ratio is UTF-8 bytes per token (higher = fewer tokens for the same text), on a few built-in texts of different
kinds and on samples of the corpus's train and val splits.

    python -m scripts.tok_eval

GPT-2 (50,257 tokens) and GPT-4 (cl100k_base, 100,277 tokens) come from tiktoken, which downloads their
files once and caches them ($TIKTOKEN_CACHE_DIR, else <tmp>/data-gym-cache). Offline and not cached, the
comparison is skipped with a message; the script never hangs on the network (download_timeout).
"""

import hashlib
import os
import tempfile
import threading

import tiktoken

from nanochat.configurator import check_config, configure
from nanochat.dataset import dataset_name, parquets_iter_batched
from nanochat.output import print0
from nanochat.report import get_report
from nanochat.rerun import RERUN_CHOICES, corpus_input, skip_if_done, tokenizer_input
from nanochat.tokenizer import get_tokenizer

sample_chars = 1_000_000  # characters of the train split and of the val split to measure on
download_reference = True  # fetch the GPT-2/GPT-4 files when not cached (needs internet)
download_timeout = 20.0  # seconds to wait for that download before skipping the comparison
rerun = "no"  # auto (bash speedrun.sh): skipped if its report section was made from the same settings and inputs
config = configure(globals())
check_config(config, choices={"rerun": RERUN_CHOICES})
# What the evaluation is made from: these settings, the tokenizer and the corpus; made already from them
# (--rerun=auto), it says so and exits 0 here (nanochat/rerun.py)
made_from = skip_if_done("Tokenizer evaluation", "tok_eval", config, dict(tokenizer=tokenizer_input(),
                                                                          corpus=corpus_input()))

# -----------------------------------------------------------------------------
# Texts of different kinds: compression differs a lot between them, and shows what the corpus covered

TEXTS = {}
TEXTS["english"] = """\
The river had been rising for three days before anyone in the village took it seriously. On the fourth
morning the baker found water lapping at his doorstep, and by noon the square was a shallow lake in which
the church tower stood reflected, upside down and trembling. Nobody drowned; the old people said it had
happened before, in their grandparents' time, and that the water always went back where it came from.
It did, eventually, leaving behind a line of brown silt on every wall that stayed there for years.
"""
TEXTS["python"] = """\
def moving_average(values, window):
    \"\"\"Mean of each run of `window` consecutive values (len(values) - window + 1 results).\"\"\"
    if window < 1 or window > len(values):
        raise ValueError(f"window must be in 1..{len(values)}, got {window}")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


if __name__ == "__main__":
    print(moving_average([3, 1, 4, 1, 5, 9, 2, 6], window=3))
"""
TEXTS["math"] = r"""
Let $f(x) = \sum_{k=0}^{\infty} \frac{x^k}{k!}$. Differentiating term by term gives $f'(x) = f(x)$ with
$f(0) = 1$, hence $f(x) = e^x$. Similarly,
\begin{align}
  \int_0^1 x^2 \, dx &= \left[ \frac{x^3}{3} \right]_0^1 = \frac{1}{3}, \\
  \nabla \cdot \mathbf{E} &= \frac{\rho}{\varepsilon_0}, \qquad
  \lim_{n \to \infty} \left(1 + \frac{1}{n}\right)^n = e .
\end{align}
"""
TEXTS["korean"] = """\
토크나이저는 텍스트를 모델이 읽을 수 있는 정수의 나열로 바꾼다. 자주 함께 나오는 바이트 쌍을 하나의 토큰으로
합치는 과정을 반복하면, 흔한 단어는 토큰 하나가 되고 드문 단어는 여러 조각으로 나뉜다. 어휘가 클수록 같은 문장을
더 적은 토큰으로 표현할 수 있지만, 임베딩 행렬도 그만큼 커진다.
"""
TEXTS["chinese"] = """\
分词器把文本变成模型能够读取的整数序列。它反复把最常一起出现的两个字节合并成一个新的词元，于是常见的词只占一个词元，
罕见的词则被拆成好几段。词表越大，同一句话需要的词元越少，但嵌入矩阵也随之变大。
"""
TEXTS["numbers"] = """\
date,open,high,low,close,volume
2024-03-01,182.35,184.10,181.92,183.77,51234500
2024-03-04,183.80,185.47,182.01,184.96,48810200
2024-03-05,184.12,184.30,179.66,180.05,62731900
2024-03-06,180.44,182.93,179.88,182.51,45066100
pi = 3.14159265358979323846, e = 2.71828182845904523536, 2**64 = 18446744073709551616
"""


def corpus_sample(split):
    """The first documents of `split`, whole, until sample_chars characters."""
    docs = []
    chars = 0
    for batch in parquets_iter_batched(split):
        for doc in batch:
            docs.append(doc)
            chars += len(doc)
            if chars >= sample_chars:
                return docs
    return docs


# -----------------------------------------------------------------------------
# Reference encodings: GPT-2 and GPT-4, only if tiktoken has them (or can download them in time)

# The files tiktoken fetches for each encoding (see tiktoken_ext/openai_public.py); it caches each one
# under sha1(url) in its cache directory, so we can tell "cached" without touching the network.
REFERENCE = {
    "GPT-2": ("gpt2", ["https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                       "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"]),
    "GPT-4": ("cl100k_base", ["https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"]),
}


def tiktoken_cache_dir():
    """Where tiktoken caches downloads (same rule as tiktoken.load.read_file_cached); "" = caching off."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def is_cached(urls):
    cache_dir = tiktoken_cache_dir()
    return bool(cache_dir) and all(os.path.exists(os.path.join(cache_dir, hashlib.sha1(u.encode()).hexdigest()))
                                   for u in urls)


def load_reference(encoding_name, urls):
    """(Encoding or None, why not). Loads from the cache; otherwise downloads within download_timeout."""
    if is_cached(urls):
        return tiktoken.get_encoding(encoding_name), None
    if not download_reference:
        return None, "download_reference=false"
    # tiktoken.get_encoding has no timeout: run it in a daemon thread and stop waiting after download_timeout
    result = {}

    def fetch():
        try:
            result["encoding"] = tiktoken.get_encoding(encoding_name)
        except Exception as e:  # no network: requests' ConnectionError; anything else: report it, don't crash
            result["error"] = f"{type(e).__name__}"

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(download_timeout)
    if "encoding" in result:
        return result["encoding"], None
    return None, result.get("error", f"no answer in {download_timeout:.0f}s")


# -----------------------------------------------------------------------------
# Measure

tokenizer = get_tokenizer()
corpus = dataset_name()
encoders = {"ours": lambda texts: tokenizer.encode(texts)}
missing = []
reasons = []
for label, (encoding_name, urls) in REFERENCE.items():
    encoding, why = load_reference(encoding_name, urls)
    if encoding is None:
        missing.append(label)
        reasons.append(f"{label}: {why}")
    else:
        encoders[label] = encoding.encode_ordinary_batch
if missing:
    print0(f"{'/'.join(missing)} encoding{'s' if len(missing) > 1 else ''} unavailable offline "
           f"(no cached tiktoken files); skipping comparison ({'; '.join(reasons)})")

samples = {name: [text] for name, text in TEXTS.items()}
samples[f"{corpus} train"] = corpus_sample("train")
samples[f"{corpus} val"] = corpus_sample("val")

results = {}  # (sample, encoder) -> number of tokens
num_bytes = {}
for name, docs in samples.items():
    num_bytes[name] = sum(len(d.encode("utf-8")) for d in docs)
    for enc_name, encode in encoders.items():
        results[name, enc_name] = sum(len(ids) for ids in encode(docs))

# A markdown table: it reads well in the terminal and goes into the report as is
header = ["text", "bytes"] + [f"{e} tokens" for e in encoders] + [f"{e} bytes/token" for e in encoders]
if "GPT-4" in encoders:
    header.append("ours vs GPT-4 tokens")
rows = []
for name in samples:
    row = [name, f"{num_bytes[name]:,}"]
    row += [f"{results[name, e]:,}" for e in encoders]
    row += [f"{num_bytes[name] / max(results[name, e], 1):.2f}" for e in encoders]
    if "GPT-4" in encoders:
        row.append(f"{100 * (results[name, 'ours'] / results[name, 'GPT-4'] - 1):+.1f}%")
    rows.append(row)
widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(header, widths)) + " |",
         "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
table = "\n".join(lines)

print0(f"Compression of our tokenizer (vocab {tokenizer.get_vocab_size():,}, trained on {corpus}); "
       f"bytes/token: higher is better")
print0(table)

get_report().log(section="Tokenizer evaluation", made_from=made_from, data=[
    {"dataset": corpus, "vocab_size": tokenizer.get_vocab_size(), "sample_chars": sample_chars,
     "compared_with": ", ".join(e for e in encoders if e != "ours") or "none (offline, not cached)",
     "Val bytes/token": f"{num_bytes[f'{corpus} val'] / max(results[f'{corpus} val', 'ours'], 1):.2f}"},
    "",
    table,
])
