"""
The data loader of the chat stages: conversations in, rendered with their training mask, token batches out.

mid_train packs conversations into rows, chat_sft puts one in each row (ConversationLoader says how):

    loader = ConversationLoader(dataset, tokenizer, B, T, device, packed=True)
    x, y = next(loader)   # x (B, T) int32, y (B, T) int64 (-1 where not trained on), on `device`

chat_train_loader() is the two stages' training loader with the lines they print of their data. padded_batch()
pads rows of (ids, mask) into one batch: the unpacked loader's and chat_rl's policy-gradient batches. Pretraining's
loader: nanochat/dataloader.py.
"""

from collections import deque

import torch

from nanochat.dataloader import batch_to_device
from nanochat.output import UserError, print0


def padded_batch(rows, pad_id, device):
    """
    Rows of (ids, mask) of different lengths -> (inputs, targets), each (len(rows), longest - 1): inputs are
    ids[:-1], right-padded with `pad_id` (a causal model never looks ahead, so padding changes nothing before
    it); targets are ids[1:] where the mask of that token is 1, and -1 (ignored) elsewhere and in the padding.
    """
    width = max(len(ids) for ids, _ in rows) - 1
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, (ids, mask) in enumerate(rows):
        row = torch.tensor(ids, dtype=torch.long)
        inputs[r, :len(ids) - 1] = row[:-1]
        targets[r, :len(ids) - 1] = torch.where(torch.tensor(mask[1:], dtype=torch.bool), row[1:], -1)
    return inputs.to(device, torch.int32), targets.to(device)


class ConversationLoader:
    """
    Micro-batches of conversations for THIS rank, forever: rank r reads conversations r, r + W, r + 2W, ... of
    `dataset` (W = world size; only its first `size`, all if None or < 0), so ranks never read the same one, and
    the data of a step depends on the world size (a resume must use the same number of ranks). Each conversation
    is rendered with its training mask (tokenizer.render_conversation: 1 on what the assistant writes). Layouts:

    - packed=True (midtraining): conversations are appended to a token stream and a micro-batch is the next
      B*T+1 tokens (inputs the first B*T, targets shifted by one; the last token stays for the next batch), so
      rows are full and a conversation longer than a row continues in the next one (counted: stats["split"]).
    - packed=False (SFT): one whole conversation per row, cut to T+1 tokens (counted: stats["cut"]), rows padded
      to the longest of the micro-batch (padded_batch): every row starts where a conversation starts, as in a chat.

    Targets are -1 where the mask is 0 (user turns, tool outputs, padding) unless train_on_all_tokens.
    `epoch_done` turns True when this rank's reading wraps around the dataset; progress() is how far this rank
    is through the epoch (the learning-rate schedule of a run of one epoch follows it). next_step(n): the n
    micro-batches of an optimizer step at once (a chat stage counts their targets before its first backward).

    state_dict() is where the next batch starts plus what was read so far; load_state_dict() takes the list of
    every rank's state_dict (as a checkpoint keeps them) and continues this rank's exactly. Packed: what a batch
    leaves in the buffer is always the tail of ONE conversation (the buffer is refilled one conversation at a
    time, only until it holds a batch), so the position is [conversation index, token offset into it].
    """

    def __init__(self, dataset, tokenizer, B, T, device, *, packed, size=None, rank=0, world_size=1,
                 train_on_all_tokens=False):
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.B = B
        self.T = T
        self.device = torch.device(device)
        self.packed = packed
        self.train_on_all_tokens = train_on_all_tokens
        self.rank = rank
        self.world_size = world_size
        self.size = len(dataset) if size is None or size < 0 else min(size, len(dataset))
        self.pad_id = tokenizer.encode_special("<|assistant_end|>")  # any id does: padded targets are ignored
        self.load_state_dict(None)

    def state_dict(self):
        return {"position": list(self.position), "reread": self.position_read, "epoch_done": self.epoch_done,
                "stats": dict(self.stats, first=list(self.stats["first"]))}

    def load_state_dict(self, states):
        """`states`: every rank's state_dict, as a checkpoint keeps them, or None to start at the beginning."""
        state = None if states is None else states[self.rank]
        self.position = (self.rank, 0) if state is None else tuple(state["position"])  # where the next batch starts
        self.cursor, self.skip = self.position  # the next conversation to read, and tokens of it already trained on
        # packed: after a batch, the conversation at the position was read (and counted) already, even at offset 0
        self.reread = self.position_read = state is not None and state["reread"]
        self.epoch_done = False if state is None else state["epoch_done"]
        # read: conversations started; first: the indices of the first 8 (shows which ranks read which)
        stats = {"read": 0, "split": 0, "cut": 0, "first": []} if state is None else state["stats"]
        self.stats = dict(stats, first=list(stats["first"]))  # a copy: the caller's states stay as they were
        # packed: the token buffer, and [conversation index, its tokens in the buffer, offset of the first of them]
        self.ids = deque()
        self.mask = deque()
        self.segments = deque()

    def __iter__(self):
        return self

    def next_step(self, n):
        """(the state_dict() where they start: what a checkpoint saved before this step keeps, [n micro-batches])"""
        state = self.state_dict()
        return state, [next(self) for _ in range(n)]

    def progress(self, step, num_iterations):
        """
        How far a run is, for its schedule: (step, num_iterations) for a run of num_iterations steps, else (-1: one
        epoch) (the dataset index of this rank's next conversation, or `size` once its epoch is done; `size`, the
        conversations of the whole mixture that the loader reads). Not a count: rank r reads r, r + W, ..., so the
        index runs over the whole mixture and the ratio is how far through the epoch this rank is.
        """
        if num_iterations > 0:
            return step, num_iterations
        return (self.size if self.epoch_done else self.cursor), self.size

    def _read(self):
        """The next conversation of this rank, rendered: (index, ids, mask), counted; moves the cursor past it."""
        index = self.cursor
        ids, mask = self.tokenizer.render_conversation(self.dataset[index], max_tokens=10**9)
        self.cursor += self.world_size
        if self.cursor >= self.size:
            self.cursor -= self.size  # wrap around: the next epoch
            self.epoch_done = True
        if self.reread:  # resuming inside this conversation: it was already read and counted
            skip = self.skip
            self.skip = 0
            self.reread = False
            return index, ids[skip:], mask[skip:]
        self.stats["read"] += 1
        self.stats["split" if self.packed else "cut"] += len(ids) > self.T + 1
        if len(self.stats["first"]) < 8:
            self.stats["first"].append(index)
        return index, ids, mask

    def __next__(self):
        if not self.packed:
            rows = []
            for _ in range(self.B):
                _, ids, mask = self._read()
                ids = ids[:self.T + 1]
                rows.append((ids, [1] * len(ids) if self.train_on_all_tokens else mask[:self.T + 1]))
            self.position = (self.cursor, 0)
            return padded_batch(rows, self.pad_id, self.device)
        needed = self.B * self.T + 1
        while len(self.ids) < needed:
            offset = self.skip
            index, ids, mask = self._read()
            self.segments.append([index, len(ids), offset])
            self.ids.extend(ids)
            self.mask.extend(mask)
        ids = [self.ids.popleft() for _ in range(needed - 1)] + [self.ids[0]]  # the last one stays for the next batch
        mask = [self.mask.popleft() for _ in range(needed - 1)] + [self.mask[0]]
        consumed = needed - 1
        while consumed:  # move the segment bookkeeping past the consumed tokens
            take = min(consumed, self.segments[0][1])
            self.segments[0][1] -= take
            self.segments[0][2] += take
            consumed -= take
            if self.segments[0][1] == 0:
                self.segments.popleft()
        self.position = (self.segments[0][0], self.segments[0][2])  # the leftover is the tail of segments[0]
        self.position_read = True
        tokens = torch.tensor(ids, dtype=torch.int64)
        inputs = tokens[:-1].view(self.B, self.T)
        targets = tokens[1:].view(self.B, self.T)
        if not self.train_on_all_tokens:  # the loss counts only what the model must learn to write (mask 1)
            targets = torch.where(torch.tensor(mask[1:], dtype=torch.bool).view(self.B, self.T), targets, -1)
        return batch_to_device(inputs, targets, self.device)


def chat_train_loader(train_dataset, val_dataset, tokenizer, B, T, device, *, mixture, conversations, own_split,
                      size, **loader_args):
    """
    The training loader of a chat stage (mid_train, chat_sft): a ConversationLoader of `train_dataset`'s first `size`
    conversations, and the lines both stages print of their data: the mixture's counts, and with --conversations
    (`conversations`, the file; `own_split`, its (validation, training) counts: tasks.registry.conversations_split)
    how the file splits. UserError unless every rank reads at least one training and one validation conversation
    (rank r reads r, r + W, ...).
    """
    loader = ConversationLoader(train_dataset, tokenizer, B, T, device, size=size, **loader_args)
    print0(f"Mixture {mixture}: {loader.size:,} training conversations (of {len(train_dataset):,}), "
           f"{len(val_dataset):,} validation")
    if conversations:
        own_val, own_train = own_split
        print0(f"Your conversations ({conversations}): {own_train:,} training, {own_val:,} validation "
               f"(its first max(1, n // 20))")
    if min(loader.size, len(val_dataset)) < loader.world_size:
        raise UserError(f"{loader.size} training and {len(val_dataset)} validation conversations for "
                        f"{loader.world_size} ranks: every rank needs one of each (of a --conversations file, the "
                        f"first n // 20 are validation); use fewer processes or more conversations")
    return loader
