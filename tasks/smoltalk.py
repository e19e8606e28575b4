"""
SmolTalk (HuggingFaceTB/smol-smoltalk): general chat conversations, the subset selected for small models.

Rewriting, summarising, everyday talk, following constraints, ...: the subset of SmolTalk Hugging Face selected for
small models. This is what teaches the model the chat format itself: user and assistant turns, sometimes with a
system message.

Files, fetched once each from the Hugging Face hub (tasks.common.hf_download) and read with pyarrow:
    HuggingFaceTB/smol-smoltalk  data/train-00000-of-00001.parquet   ~460K conversations
                                 data/test-00000-of-00001.parquet     ~24K conversations
Column used: messages, a list of {content: str, role: "system"|"user"|"assistant"}; an optional system
message comes first, then user and assistant alternate. (The files also have a `source` column: which
generator made the conversation. It is not used.)

Generative, with no automatic evaluation: there is no single right answer to check against, so the task is
used for training and for validation loss only; evaluate() raises NotImplementedError.
"""



from tasks.common import Task, hf_parquet, check_choice

REPO = "HuggingFaceTB/smol-smoltalk"
SPLITS = ("train", "test")


class SmolTalk(Task):
    """SmolTalk(split="train"|"test", start=0, stop=None, step=1)."""

    eval_type = "generative"

    def __init__(self, split="train", **kwargs):
        check_choice("SmolTalk split", split, SPLITS)
        table = hf_parquet(REPO, f"data/{split}-00000-of-00001.parquet", ("messages",))
        # Kept in Arrow: ~460K conversations are far more compact there than as Python dicts (which matters
        # with one copy per process under torchrun); get_example converts one at a time. The chunks are not
        # combined: more than 2 GB of text in one string array would overflow its 32-bit offsets.
        self.messages = table.column("messages")
        super().__init__(**kwargs)

    def num_examples(self):
        return len(self.messages)

    def get_example(self, index):
        messages = self.messages[index].as_py()
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}

    def evaluate(self, conversation, assistant_response):
        raise NotImplementedError("SmolTalk has no automatic evaluation (open-ended conversations): use it for "
                                  "training and validation loss")
