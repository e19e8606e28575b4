"""
Download, once, every file the chat stages and evaluations of a real (GPU) run read, so that a run never
discovers in the middle of a training stage that the network is down:

    python -m tasks.prefetch            # task files (SmolTalk, MMLU, GSM8K, ARC, HumanEval), DCLM's CORE bundle,
                                        # and the identity conversations (generated, no download)

Each file goes through download_file_with_lock (locked, atomic, skipped when present), exactly as the stages
will read it; running it again does nothing. A failure names the file and the command to run again.
"""

import os

from nanochat.common import get_base_dir, setup_default_logging


def main():
    setup_default_logging()
    from nanochat.core_eval import prepare_bundle
    from tasks.arc import ARC
    from tasks.gsm8k import GSM8K
    from tasks.humaneval import HumanEval
    from tasks.identity import write_identity_jsonl
    from tasks.mmlu import MMLU
    from tasks.smoltalk import SmolTalk
    fetched = {
        "SmolTalk train, test": [SmolTalk(split="train"), SmolTalk(split="test")],
        "MMLU auxiliary_train, all test": [MMLU(subset="auxiliary_train", split="train"), MMLU(subset="all", split="test")],
        "GSM8K train, test": [GSM8K(subset="main", split="train"), GSM8K(subset="main", split="test")],
        "ARC-Easy, ARC-Challenge train, test": [ARC(subset=s, split=p) for s in ("ARC-Easy", "ARC-Challenge") for p in ("train", "test")],
        "HumanEval": [HumanEval()],
    }
    for name, tasks in fetched.items():
        print(f"{name}: {', '.join(f'{len(t):,}' for t in tasks)} examples")
    print(f"CORE bundle: {prepare_bundle('dclm')}")
    print(f"identity conversations: {write_identity_jsonl(os.path.join(get_base_dir(), 'identity_conversations.jsonl'))}")


if __name__ == "__main__":
    main()
