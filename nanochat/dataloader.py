"""
The pretraining data loader: parquet documents in, (inputs, targets) token batches out, forever.

    loader = tokenizing_distributed_data_loader(B, T, "train", device, total_batch_size=...)
    x, y = next(loader)   # x (B, T) int32, y (B, T) int64, on `device`, for THIS rank only

Each call returns one micro-batch of B rows for this rank: `B = device_batch_size`, never B x world_size.

World-size invariance. A training step consumes `total_batch_size` tokens = S micro-batches of B x T
tokens, S = total_batch_size / (B * T). We call them the step's S *data slots*. Slot s always reads the
same sub-stream of the corpus (units s, s+S, s+2S, ... of a fixed unit order, see below), and produces
exactly one micro-batch per step. Rank r, with A = S / world_size gradient-accumulation steps, serves
slots r*A, r*A+1, ..., r*A+A-1, in that order. So what a step sees depends only on (corpus, seed, B, T,
total_batch_size): 2 ranks x accumulation 1 see the same micro-batches as 1 rank x accumulation 2
(slot 0 then slot 1), and since the gradient is averaged over all S micro-batches either way, they train
the same model. Different slots never read the same document.

Units. The corpus is a fixed, ordered list of parquet row groups (~1024 documents each), listed once when
the loader is built. If there are fewer row groups than slots, each row group is split into
k = ceil(S / R) units (documents j, j+k, j+2k, ... of it) so every slot has data. For the train split the
unit order is shuffled each epoch with random.Random(f"{seed}-{epoch}"); val is read in order.

Tokens. A slot tokenizes its documents in batches on threads (tiktoken releases the GIL), prepends BOS to
every document, and keeps the tokens in a buffer. A micro-batch is the next B*T+1 tokens of the buffer:
inputs are the first B*T, targets the same shifted by one; the last token is kept for the next batch.
With `bos_aligned=True` each row instead starts at the beginning of a document (BOS first): rows are
filled with whole documents and the last one is cropped; the fraction of tokens dropped is counted.

Resuming. `loader.state_dict()` is a small dict (per slot: epoch, unit, document, token offset) giving the
position of the batch most recently returned; a loader built with `resume_state=` that dict returns that
same batch first, then continues exactly. (The training loop prefetches the next batch, so the batch it
holds when it saves a checkpoint is the first one the resumed run must see.) Slot states can be merged
across ranks (they are keyed by slot), so the state of all ranks fits in the checkpoint's meta.
"""

import random
from collections import deque

import numpy as np
import torch

from nanochat.common import grad_accum_steps_for, print0
from nanochat.dataset import list_row_groups, read_row_group


def _units(row_groups, num_slots):
    """Split the row groups into at least `num_slots` units: (row group index, j, k) = docs j::k."""
    k = max(1, -(-num_slots // len(row_groups)))
    return [(g, j, k) for g in range(len(row_groups)) for j in range(k)]


class _Slot:
    """One data slot: its own position in the corpus and its own token buffer."""

    def __init__(self, slot, num_slots, row_groups, seed, tokenizer, bos_id, threads, doc_batch, shuffle, split, state=None):
        self.slot, self.num_slots, self.row_groups, self.seed, self.shuffle = slot, num_slots, row_groups, seed, shuffle
        self.tokenizer, self.bos_id, self.threads, self.doc_batch, self.split = tokenizer, bos_id, threads, doc_batch, split
        # reading position: the next document to tokenize is document `next_doc` of unit `unit_pos` of `epoch`
        self.epoch, self.unit_pos, self.next_doc, resume_offset = state if state is not None else (0, 0, 0, 0)
        self._set_epoch_units()
        self.unit_texts = None
        # token buffer: entries [epoch, unit_pos, doc_idx, tokens]; the first one is consumed up to self.offset
        self.docs = deque()
        self.offset = 0
        self.buffered = 0  # tokens in the buffer not yet consumed
        self.tokens_seen, self.tokens_dropped = 0, 0
        if resume_offset:
            self._refill()
            self.offset = resume_offset
            self.buffered -= resume_offset

    def _set_epoch_units(self):
        units = _units(self.row_groups, self.num_slots)
        if self.shuffle:
            random.Random(f"{self.seed}-{self.epoch}").shuffle(units)
        self.my_units = units[self.slot::self.num_slots]

    def state(self):
        """(epoch, unit, document, token offset) of the first token not yet returned."""
        if self.docs:
            epoch, unit_pos, doc_idx, _ = self.docs[0]
            return (epoch, unit_pos, doc_idx, self.offset)
        return (self.epoch, self.unit_pos, self.next_doc, 0)

    def _refill(self):
        """Tokenize the next few documents of this slot into the buffer."""
        if self.unit_texts is None:
            g, j, k = self.my_units[self.unit_pos]
            self.unit_texts = read_row_group(*self.row_groups[g])[j::k]
        texts = self.unit_texts[self.next_doc:self.next_doc + self.doc_batch]
        for i, ids in enumerate(self.tokenizer.encode(texts, prepend=self.bos_id, num_threads=self.threads) if texts else []):
            self.docs.append([self.epoch, self.unit_pos, self.next_doc + i, np.asarray(ids, dtype=np.int32)])
            self.buffered += len(ids)
            self.tokens_seen += len(ids)
        self.next_doc += len(texts)
        if self.next_doc >= len(self.unit_texts):  # unit done: next unit, or next epoch
            self.unit_texts, self.next_doc = None, 0
            self.unit_pos += 1
            if self.unit_pos == len(self.my_units):
                self.epoch, self.unit_pos = self.epoch + 1, 0
                self._set_epoch_units()
                print0(f"Data slot {self.slot} ({self.split}): starting epoch {self.epoch}")

    def take_tokens(self, n):
        """The next n+1 tokens; advances by n (the last token is also the first of the next call)."""
        while self.buffered < n + 1:
            self._refill()
        out = np.empty(n + 1, dtype=np.int32)
        filled, start = 0, self.offset
        for entry in self.docs:
            chunk = entry[3][start:start + n + 1 - filled]
            out[filled:filled + len(chunk)] = chunk
            filled, start = filled + len(chunk), 0
            if filled == n + 1:
                break
        remaining = n  # advance by n: drop fully consumed documents, move the offset into the next one
        while remaining >= len(self.docs[0][3]) - self.offset:
            remaining -= len(self.docs.popleft()[3]) - self.offset
            self.offset = 0
        self.offset += remaining
        self.buffered -= n
        return out

    def take_rows(self, rows, width):
        """bos_aligned mode: `rows` rows of `width` tokens, each starting at a document start (BOS)."""
        out = np.empty((rows, width), dtype=np.int32)
        for r in range(rows):
            filled = 0
            while filled < width:
                while not self.docs:
                    self._refill()
                tokens = self.docs.popleft()[3]
                take = min(len(tokens), width - filled)
                out[r, filled:filled + take] = tokens[:take]
                filled += take
                self.tokens_dropped += len(tokens) - take  # the cropped tail of the row's last document
                self.buffered -= len(tokens)
        return out


class DistributedTokenLoader:
    """Iterator of (inputs, targets) micro-batches for one rank; see the module docstring."""

    def __init__(self, *, B, T, split, device, tokenizer, rank, world_size, total_batch_size=None, seed=0,
                 resume_state=None, bos_aligned=False, tokenizer_threads=4, tokenizer_batch_size=128):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.B, self.T, self.split, self.device, self.bos_aligned = B, T, split, torch.device(device), bos_aligned
        if total_batch_size is None:  # one slot per rank, e.g. for evaluation
            total_batch_size = B * T * world_size
        self.accum = grad_accum_steps_for(total_batch_size, B, T, world_size)  # micro-batches per rank per step
        self.num_slots = self.accum * world_size
        self.my_slots = list(range(rank * self.accum, (rank + 1) * self.accum))
        slot_states = (resume_state or {}).get("slots", {})
        # The corpus is listed once, here: every epoch reads the same units (shards downloaded later are not
        # picked up mid-run, which keeps the data order reproducible)
        row_groups = list_row_groups(split)
        bos_id = tokenizer.get_bos_token_id()
        self.slots = [_Slot(s, self.num_slots, row_groups, seed, tokenizer, bos_id, tokenizer_threads, tokenizer_batch_size,
                            shuffle=(split == "train"), split=split, state=slot_states.get(str(s)))
                      for s in self.my_slots]
        self.micro = (resume_state or {}).get("micro", 0) % self.accum  # which of my slots serves the next batch
        self.last = None  # (slot index, state before the last returned batch)

    def __iter__(self):
        return self

    def __next__(self):
        i = self.micro
        slot = self.slots[i]
        self.last = (i, slot.state())
        if self.bos_aligned:
            rows = slot.take_rows(self.B, self.T + 1)
            inputs, targets = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
        else:
            buf = torch.from_numpy(slot.take_tokens(self.B * self.T))
            inputs, targets = buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)
        self.micro = (self.micro + 1) % len(self.slots)
        if self.device.type == "cuda":
            # page-locked staging memory lets the copy to the GPU run asynchronously (non_blocking); the
            # caching host allocator keeps each buffer alive until its copy has finished
            inputs = inputs.to(torch.int32).pin_memory().to(self.device, non_blocking=True)
            targets = targets.to(torch.int64).pin_memory().to(self.device, non_blocking=True)
            return inputs, targets
        return inputs.to(self.device, torch.int32).contiguous(), targets.to(self.device, torch.int64)

    @property
    def epoch(self):
        return min(s.epoch for s in self.slots)

    def dropped_fraction(self):
        seen = sum(s.tokens_seen for s in self.slots)
        return sum(s.tokens_dropped for s in self.slots) / max(seen, 1)

    def state_dict(self):
        """Position of the most recently returned batch (resuming returns it again first)."""
        states = {str(s.slot): list(s.state()) for s in self.slots}
        micro = self.micro
        if self.last is not None:
            i, before = self.last
            states[str(self.slots[i].slot)] = list(before)
            micro = i
        return {"slots": states, "micro": micro, "num_slots": self.num_slots, "split": self.split}


def tokenizing_distributed_data_loader(B, T, split, device="cpu", *, tokenizer=None, total_batch_size=None, seed=0,
                                       resume_state=None, bos_aligned=False, tokenizer_threads=4,
                                       tokenizer_batch_size=128):
    """
    Micro-batches of (B, T) tokens of `split` for this rank. `total_batch_size` (tokens per optimizer
    step across all ranks) defines the data slots; None means one slot per rank (evaluation).
    """
    from nanochat.common import get_dist_info
    from nanochat.tokenizer import get_tokenizer
    _, rank, _, world_size = get_dist_info()
    tokenizer = tokenizer or get_tokenizer()
    return DistributedTokenLoader(B=B, T=T, split=split, device=device, tokenizer=tokenizer, rank=rank,
                                  world_size=world_size, total_batch_size=total_batch_size, seed=seed,
                                  resume_state=resume_state, bos_aligned=bos_aligned,
                                  tokenizer_threads=tokenizer_threads, tokenizer_batch_size=tokenizer_batch_size)
