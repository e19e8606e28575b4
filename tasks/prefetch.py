"""
The prefetch: every file the chat stages and evaluations of a real (GPU) run read, downloaded once up front.

So that a run never discovers in the middle of a training stage that the network is down:

    python -m tasks.prefetch            # the task files (the splits real runs read of every task of tasks/registry.py
                                        # that downloads: SmolTalk, MMLU, GSM8K, ARC, HumanEval), DCLM's CORE bundle,
                                        # and the identity conversations (generated, no download)

Each file goes through download_file_with_lock (locked, atomic, skipped when present), exactly as the stages
will read it; running it again does nothing. A failure names the file and the command to run again.
"""

from nanochat.output import setup_default_logging


def main():
    setup_default_logging()
    from nanochat.core_eval import prepare_bundle
    from tasks.registry import identity_jsonl, real_run_splits
    for task, splits in real_run_splits():
        built = [task.build(split=split) for split in splits]  # a task downloads its files when built
        print(f"{task.name} {', '.join(splits)}: {', '.join(f'{len(t):,}' for t in built)} examples")
    print(f"CORE bundle: {prepare_bundle('dclm')}")
    print(f"identity conversations: {identity_jsonl()}")


if __name__ == "__main__":
    main()
