"""
The CORE metric: nanochat/core_eval.py, nanochat/core_bundle.py (its offline bundle) and scripts/base_eval.py.

The fixture tests/fixtures/core_bundle/eval_bundle/ is a tiny bundle in DCLM's format (core.yaml, eval_data/,
eval_meta_data.csv): 3 tasks, one per type. The tests zip it, serve it over local HTTP and let prepare_bundle
download and unzip it, then score two stand-in models whose answers are known by hand:

  PrefersText(gold texts)   every answer right: accuracy 1 everywhere, CORE 1.0
  PrefersText(wrong texts)  tiny_mc: always choice 0, right for golds [0, 2, 0, 1, 3] -> 2/5 = 0.4,
                                     centered (0.4 - 0.25) / 0.75 = 0.2
                            tiny_schema: always option 0, golds [0, 1, 1, 0] -> 0.5, centered 0.0
                            tiny_lm: right continuation for 1 of 4 contexts -> 0.25, centered 0.25
                            CORE = (0.2 + 0.0 + 0.25) / 3 = 0.15
"""

import json
import os
import random
import shutil
import time
import zipfile

import pytest
import torch

from helpers import REPO_ROOT, build_once, run_script
from nanochat.core_eval import (PAD_SLACK, continuation_rows, evaluate_core, evaluate_task, fewshot_indices,
                                load_bundle, load_task_data, pack_rows, prepare_bundle, render_prompts)
from nanochat.output import UserError
from nanochat.tokenizer import Tokenizer

FIXTURE = os.path.join(REPO_ROOT, "tests", "fixtures", "core_bundle")


def byte_tokenizer():
    """A real Tokenizer with no merges: one token per byte (265 ids with the special tokens)."""
    return Tokenizer({bytes([i]): i for i in range(256)})


class PrefersText(torch.nn.Module):
    """
    A stand-in language model whose knowledge is a list of texts. At each position it finds the longest run of
    tokens ending there that is a prefix of one of its texts and puts logit BOOST on the token that text has
    next (the first such text on ties); all other logits are 0. A function of the token ids alone and causal:
    it knows nothing of tasks, rows, padding or answers, so it only wins where the evaluation renders the texts
    it knows and scores the right span.
    """

    BOOST = 10.0

    def __init__(self, tokenizer, texts):
        super().__init__()
        self.seqs = [tokenizer.encode(t) for t in texts]
        self.vocab_size = tokenizer.get_vocab_size()

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.vocab_size)
        for b, row in enumerate(idx.tolist()):
            active = []  # (text index, tokens of it matched so far, ending at this position)
            for t, token in enumerate(row):
                active = [(s, n + 1) for s, n in active if self.seqs[s][n] == token]
                active += [(s, 1) for s, seq in enumerate(self.seqs) if seq[0] == token]
                active = [(s, n) for s, n in active if n < len(self.seqs[s])]
                if active:
                    s, n = max(active, key=lambda a: a[1])
                    logits[b, t, self.seqs[s][n]] = self.BOOST
        return logits


def fixture_data(name):
    folder = "world_knowledge" if name == "tiny_mc" else "language_understanding"
    return load_task_data(os.path.join(FIXTURE, "eval_bundle", "eval_data", folder, f"{name}.jsonl"))


def gold_texts():
    texts = [f"{x['query']}\nAnswer: {x['choices'][x['gold']]}" for x in fixture_data("tiny_mc")]
    texts += [f"{x['context_options'][x['gold']]} {x['continuation']}" for x in fixture_data("tiny_schema")]
    texts += [f"{x['context'].strip()} {x['continuation']}" for x in fixture_data("tiny_lm")]
    return texts


WRONG_LM = {"To be or not to be, that is the": "answer", "One, two, three, four,": "six",
            "Roses are red, violets are": "green"}


def wrong_texts():
    texts = [f"{x['query']}\nAnswer: {x['choices'][0]}" for x in fixture_data("tiny_mc")]
    texts += [f"{x['context_options'][0]} {x['continuation']}" for x in fixture_data("tiny_schema")]
    texts += [f"{x['context'].strip()} {WRONG_LM.get(x['context'].strip(), x['continuation'])}"
              for x in fixture_data("tiny_lm")]
    return texts


def zip_fixture(path):
    """The fixture zipped the way DCLM's eval_bundle.zip is: one top folder eval_bundle/."""
    with zipfile.ZipFile(path, "w") as zf:
        for directory, _, files in sorted(os.walk(FIXTURE)):
            for f in sorted(files):
                full = os.path.join(directory, f)
                zf.write(full, os.path.relpath(full, FIXTURE))


@pytest.fixture
def served_bundle(file_server, monkeypatch):
    """The fixture bundle as eval_bundle.zip on the local file server; NANOCHAT_EVAL_BUNDLE_URL points at it."""
    zip_fixture(os.path.join(file_server.root, "eval_bundle.zip"))
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"{file_server.url}/eval_bundle.zip")
    return file_server


@pytest.fixture(scope="module")
def offline_bundle(tmp_path_factory):
    """
    The offline bundle, built once per test session (conftest.build_once) in its own base dir; (directory,
    build seconds).
    """
    def build(base):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_BASE_DIR", str(base))
            t0 = time.time()
            directory = prepare_bundle("offline")
            (base / "build.json").write_text(json.dumps({"directory": directory, "seconds": time.time() - t0}))
    build_info = json.loads((build_once(tmp_path_factory, "offline_bundle_base", build) / "build.json").read_text())
    return build_info["directory"], build_info["seconds"]


# -----------------------------------------------------------------------------
# the bundle: download, unzip, format


def test_download_unzip_and_read(served_bundle, isolated_env):
    bundle_dir = prepare_bundle("dclm")
    assert bundle_dir == str(isolated_env / "eval_bundle")
    assert served_bundle.requests == {"/eval_bundle.zip": 1}
    bundle = load_bundle(bundle_dir)
    assert bundle["name"] == "CORE"
    got = [(t["label"], t["type"], t["num_fewshot"], t["delimiter"], t["baseline"]) for t in bundle["tasks"]]
    assert got == [("tiny_mc", "multiple_choice", 3, "\nAnswer: ", 0.25), ("tiny_schema", "schema", 1, " ", 0.5),
                   ("tiny_lm", "language_modeling", 2, " ", 0.0)]  # tiny_lm: the default delimiter
    assert len(load_task_data(bundle["tasks"][1]["path"])) == 4  # the trailing blank line is no example
    assert prepare_bundle("dclm") == bundle_dir and served_bundle.requests == {"/eval_bundle.zip": 1}
    with pytest.raises(UserError, match="unknown eval bundle 'dcml'"):
        prepare_bundle("dcml")


def test_default_kind_follows_the_corpus(monkeypatch):
    from nanochat.core_eval import default_bundle_kind
    monkeypatch.setenv("NANOCHAT_DATASET", "pydocs")
    assert default_bundle_kind() == "offline"
    monkeypatch.setenv("NANOCHAT_DATASET", "fineweb-edu")
    assert default_bundle_kind() == "dclm"


def test_killed_unzip_leaves_no_bundle(served_bundle, isolated_env):
    # a process that dies (SIGKILL) while extracting the 3rd file of the zip
    code = ("import os, zipfile\n"
            "from nanochat.core_eval import prepare_bundle\n"
            "extract, calls = zipfile.ZipFile._extract_member, []\n"
            "def dying(self, *args):\n"
            "    calls.append(1)\n"
            "    if len(calls) == 3:\n"
            "        os.kill(os.getpid(), 9)\n"
            "    return extract(self, *args)\n"
            "zipfile.ZipFile._extract_member = dying\n"
            "prepare_bundle('dclm')\n")
    result = run_script("-c", code, timeout=120)
    assert result.returncode == -9, result.stderr
    leftovers = [d for d in os.listdir(isolated_env) if d.startswith("eval_bundle.tmp")]
    assert not (isolated_env / "eval_bundle").exists() and len(leftovers) == 1  # half a bundle, under a temp name
    bundle_dir = prepare_bundle("dclm")  # the next call cleans up and unzips again, without re-downloading
    assert [t["label"] for t in load_bundle(bundle_dir)["tasks"]] == ["tiny_mc", "tiny_schema", "tiny_lm"]
    assert not [d for d in os.listdir(isolated_env) if d.startswith("eval_bundle.tmp")]
    assert served_bundle.requests == {"/eval_bundle.zip": 1}


def test_corrupt_zip_is_removed(file_server, isolated_env, monkeypatch):
    with open(os.path.join(file_server.root, "eval_bundle.zip"), "wb") as f:
        f.write(b"<html>not a zip</html>")
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"{file_server.url}/eval_bundle.zip")
    with pytest.raises(UserError, match="is not a zip file"):
        prepare_bundle("dclm")
    assert not (isolated_env / "eval_bundle").exists() and not (isolated_env / "eval_bundle.zip").exists()


def test_download_failure_says_what_to_do(file_server, isolated_env, monkeypatch):
    monkeypatch.setenv("NANOCHAT_EVAL_BUNDLE_URL", f"{file_server.url}/missing.zip")  # 404: no retries
    with pytest.raises(UserError, match=r"could not download .*missing.zip.*--bundle=offline"):
        prepare_bundle("dclm")
    assert not (isolated_env / "eval_bundle").exists()


def test_bundle_missing_a_task_file_is_refused(tmp_path, isolated_env):
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(FIXTURE, "eval_bundle"), broken)
    os.remove(broken / "eval_data" / "language_understanding" / "tiny_lm.jsonl")
    with pytest.raises(UserError, match="task tiny_lm: .*tiny_lm.jsonl is missing"):
        load_bundle(str(broken))


# -----------------------------------------------------------------------------
# prompts


def test_render_prompts_by_hand():
    mc = {"query": "Q?", "choices": ["a", "b"], "gold": 1}
    shot = {"query": "S?", "choices": ["x", "y"], "gold": 0}
    assert render_prompts("multiple_choice", mc, "\nA: ", [shot]) == ["S?\nA: x\n\nQ?\nA: a", "S?\nA: x\n\nQ?\nA: b"]
    schema = {"context_options": ["c1", "c2"], "continuation": "end", "gold": 0}
    shot = {"context_options": ["d1", "d2"], "continuation": "fin", "gold": 1}
    assert render_prompts("schema", schema, " ", [shot]) == ["d2 fin\n\nc1 end", "d2 fin\n\nc2 end"]
    lm = {"context": " ctx  ", "continuation": "cont"}
    shot = {"context": "a\n", "continuation": "b"}
    assert render_prompts("language_modeling", lm, " ", [shot]) == ["a b\n\nctx", "a b\n\nctx cont"]


def test_continuation_spans():
    # multiple choice: after the common prefix; schema: the common suffix; LM: after the prompt without it
    assert continuation_rows("multiple_choice", [[9, 1, 2, 3], [9, 1, 4], [9, 1, 2, 5, 6]]) == [
        ([9, 1, 2, 3], 2, 4), ([9, 1, 4], 2, 3), ([9, 1, 2, 5, 6], 2, 5)]
    assert continuation_rows("schema", [[9, 1, 7, 8], [9, 2, 2, 7, 8]]) == [
        ([9, 1, 7, 8], 2, 4), ([9, 2, 2, 7, 8], 3, 5)]
    assert continuation_rows("language_modeling", [[9, 1, 2], [9, 1, 2, 3, 4]]) == [([9, 1, 2, 3, 4], 3, 5)]
    # a boundary the tokenizer merged
    assert continuation_rows("language_modeling", [[9, 1, 2], [9, 1, 5, 4]]) == [([9, 1, 5, 4], 2, 4)]
    # a choice that is a prefix of another still gets its last token scored
    assert continuation_rows("multiple_choice", [[9, 1], [9, 1, 0]]) == [([9, 1], 1, 2), ([9, 1, 0], 1, 3)]


def test_pack_rows_bounds_tokens_and_padding():
    rng = random.Random(0)
    rows = [([0] * rng.randint(5, 200), 1, 2) for _ in range(300)] + [([0] * 700, 1, 2)]
    batches = pack_rows(rows, batch_tokens=512)
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))  # every row exactly once
    for batch in batches:
        lengths = [len(rows[i][0]) for i in batch]
        assert lengths == sorted(lengths, reverse=True)
        assert len(batch) * lengths[0] <= 512 or len(batch) == 1  # the 700-token row goes alone
        assert min(lengths) >= (1 - PAD_SLACK) * lengths[0]
    assert len(batches) < 100  # and rows do share forwards


def test_fewshot_indices():
    for n, k in ((10, 3), (5, 4), (1000, 10)):
        for i in (0, 3, n - 1):
            picks = fewshot_indices(n, i, k)
            assert len(set(picks)) == k and i not in picks and all(0 <= p < n for p in picks)
            # what the reference draws: random.Random(1234 + i).sample of the list of the other indices
            assert picks == random.Random(1234 + i).sample([j for j in range(n) if j != i], k)


# -----------------------------------------------------------------------------
# scores of the rigged models, by hand


def test_model_preferring_gold_scores_one(served_bundle):
    tokenizer = byte_tokenizer()
    results = evaluate_core(PrefersText(tokenizer, gold_texts()), tokenizer, "cpu", prepare_bundle("dclm"))
    assert results["name"] == "CORE" and results["score"] == 1.0
    assert {k: (r["accuracy"], r["centered"], r["examples"]) for k, r in results["tasks"].items()} == {
        "tiny_mc": (1.0, 1.0, 5), "tiny_schema": (1.0, 1.0, 4), "tiny_lm": (1.0, 1.0, 4)}


def test_model_preferring_wrong_answers_scores_its_hand_computed_value(served_bundle):
    tokenizer = byte_tokenizer()
    results = evaluate_core(PrefersText(tokenizer, wrong_texts()), tokenizer, "cpu", prepare_bundle("dclm"))
    tasks = results["tasks"]
    assert (tasks["tiny_mc"]["correct"], tasks["tiny_schema"]["correct"], tasks["tiny_lm"]["correct"]) == (2, 2, 1)
    assert tasks["tiny_mc"]["accuracy"] == 0.4 and tasks["tiny_mc"]["centered"] == pytest.approx(0.2, abs=1e-12)
    assert tasks["tiny_schema"]["accuracy"] == 0.5 and tasks["tiny_schema"]["centered"] == 0.0
    assert tasks["tiny_lm"]["accuracy"] == 0.25 and tasks["tiny_lm"]["centered"] == 0.25
    assert results["score"] == pytest.approx(0.15, abs=1e-12)


def test_fewshot_count_is_clamped_with_a_note(served_bundle, capsys):
    tokenizer = byte_tokenizer()
    results = evaluate_core(PrefersText(tokenizer, gold_texts()), tokenizer, "cpu", prepare_bundle("dclm"),
                            max_per_task=3)
    out = capsys.readouterr().out
    assert "note: tiny_mc asks for 3 few-shot examples but has only 3 examples after max_per_task: using 2" in out
    assert [(r["shots"], r["examples"]) for r in results["tasks"].values()] == [(2, 3), (1, 3), (2, 3)]
    assert results["score"] == 1.0


def random_gpt(vocab_size, sequence_len, seed=0):
    from nanochat.gpt import GPT, config_from_depth
    torch.manual_seed(seed)
    model = GPT(config_from_depth(1, vocab_size=vocab_size, sequence_len=sequence_len))
    model.init_weights()
    with torch.no_grad():  # init_weights zeroes the head (uniform predictions, all ties): give it opinions
        model.lm_head.weight.normal_(0, 1.0)
        for block in model.transformer.h:
            block.attn.c_proj.weight.normal_(0, 0.1)
            block.mlp.c_proj.weight.normal_(0, 0.1)
    return model.eval()


def test_batched_equals_one_example_per_forward(served_bundle, offline_bundle, monkeypatch):
    import nanochat.core_eval as core_eval
    tokenizer = byte_tokenizer()
    model = random_gpt(tokenizer.get_vocab_size(), sequence_len=96)  # offline prompts are longer: cropped
    tasks = load_bundle(prepare_bundle("dclm"))["tasks"] + load_bundle(offline_bundle[0])["tasks"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny forwards: 2 threads on a busy 2-core machine spin more than they compute
    try:
        for task in tasks:
            data = load_task_data(task["path"])[:10]
            shots = min(task["num_fewshot"], 2)
            # one example per forward; one row per forward; all rows together; then in chunks of 5 examples
            runs = [evaluate_task(model, tokenizer, task, data, "cpu", shots, batch_tokens, 96)
                    for batch_tokens in (0, 100, 4096)]
            with monkeypatch.context() as m:
                m.setattr(core_eval, "EXAMPLES_PER_CHUNK", 5)
                runs.append(evaluate_task(model, tokenizer, task, data, "cpu", shots, 4096, 96))
            reference = runs[0][2]
            for correct, total, outcomes in runs[1:]:
                assert (correct, total) == runs[0][:2]
                for a, b in zip(reference, outcomes):
                    assert (a["index"], a["pred"], a["correct"]) == (b["index"], b["pred"], b["correct"])
                    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-5)
    finally:
        torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# the offline bundle


def test_offline_bundle_is_deterministic_fast_and_verbatim(offline_bundle, isolated_env):
    from nanochat.pydocs import pydocs_document, pydocs_entries
    first, build_seconds = offline_bundle
    assert build_seconds < 60  # ~5 s on 2 cores, mostly collecting the pydocs records
    second = prepare_bundle("offline")  # this test's own base dir: built again
    assert second != first

    def files(root):
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(root) for f in fs}
    assert files(first) == files(second) and len(files(first)) == 8

    bundle = load_bundle(first)
    assert bundle["name"] == "pydocs-CORE"
    assert {t["type"] for t in bundle["tasks"]} == {"multiple_choice", "schema", "language_modeling"}
    docs = [pydocs_document(r) for r in pydocs_entries()]
    for task in bundle["tasks"]:
        data = load_task_data(task["path"])
        assert len(data) >= 200, task["label"]
        assert task["baseline"] == (0.0 if task["type"] == "language_modeling" else 0.25)
        for item in data[:50]:  # every item's solved text is the start of a corpus document, verbatim
            if task["type"] == "multiple_choice":
                options = item["choices"]
                solved = f"{item['query']}{task['delimiter']}{options[item['gold']]}"
            elif task["type"] == "schema":
                options = item["context_options"]
                solved = f"{options[item['gold']]}{task['delimiter']}{item['continuation']}"
            else:
                options = [None]
                solved = f"{item['context']}{task['delimiter']}{item['continuation']}"
            assert len(set(options)) == len(options)
            assert any(d.startswith(solved) for d in docs), solved
    defaults = load_task_data(os.path.join(first, "eval_data", "pydocs", "default.jsonl"))
    golds = [x["choices"][x["gold"]] for x in defaults]
    assert {v: golds.count(v) for v in set(golds)} == {"None": 100, "True": 100, "False": 100, "0": 100}


# -----------------------------------------------------------------------------
# scripts/base_eval end to end


@pytest.mark.slow
def test_base_eval_end_to_end(tiny_model, served_bundle):
    base = tiny_model("base")
    section = base / "report" / "base-model-evaluation.md"

    def base_eval(*args, nproc=1):
        result = run_script("-m", "scripts.base_eval", "--device_type=cpu", *args, nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        report = section.read_text().split("\n", 2)[2]  # without the title and timestamp lines
        return result.stdout, report

    # the default bundle for the pydocs corpus: offline, reported under its own name
    out, report = base_eval("--max_per_task=16")
    for label in ("pydocs_summary", "pydocs_default", "pydocs_header", "pydocs_owner", "pydocs_next_word",
                  "pydocs_next_param"):
        assert label in out and f"| {label} |" in report
    assert "pydocs-CORE metric:" in out and "- pydocs-CORE metric: " in report and "\n- CORE metric" not in report

    # the dclm bundle (the fixture, downloaded from the local server): key "CORE metric"; 2 ranks == 1 rank
    out1, report1 = base_eval("--bundle=dclm", "--device_batch_tokens=256")
    assert "\nCORE metric: " in out1 and "- CORE metric: " in report1
    assert "| tiny_mc | multiple_choice | 3 | 5 |" in report1
    out2, report2 = base_eval("--bundle=dclm", "--device_batch_tokens=256", nproc=2)
    assert report2 == report1
    assert served_bundle.requests == {"/eval_bundle.zip": 1}

    bad = run_script("-m", "scripts.base_eval", "--bundle=web", timeout=120)
    assert bad.returncode == 1 and bad.stderr.strip() == "error: --bundle must be one of '', dclm, offline, got 'web'"
