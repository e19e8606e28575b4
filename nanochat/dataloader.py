"""
The data loader of pretraining: parquet documents in, token batches out, forever, for THIS rank only.

Also the micro-steps a step of total_batch_size tokens takes (grad_accum_steps_for; mid_train uses it too).

    loader = tokenizing_distributed_data_loader(B, T, "train", device, tokenizer=tokenizer, total_batch_size=...)
    x, y = next(loader)   # x (B, T) int32, y (B, T) int64, on `device`

Each call returns one micro-batch of B rows for this rank: `B = device_batch_size`, never B x world_size.
state_dict() / load_state_dict(): a checkpoint stores where every rank's data stands, and a resumed run reads
exactly the batches the uninterrupted run would have read. (The chat stages' loader: nanochat/conversation_loader.py.)

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

Best-fit rows (`bos_aligned=True`). Each row of T+1 tokens starts at a document's start (BOS), and no token
is dropped. A slot keeps a buffer of BESTFIT_BUFFER *pieces* of documents, topped up in reading order before
each placement. A row takes first the longest piece that starts a document and fits, then, again and again,
the longest piece of either kind that fits what is left; when none fits, the shortest piece is cut to fill
the row exactly and its rest goes back into the buffer as *leftover* pieces, which continue rows but never
start one (they have no BOS). Ties go to the piece that came into the buffer first. This is the loader of
karpathy/nanochat HEAD (largest fit, then the shortest cropped), except that HEAD throws the cut-off rest
away and this keeps it. Keeping it takes two more rules, without which what no row can take whole piles up
in the buffer for good (a document longer than a row would only be taken once no shorter one is left, a long
leftover once nothing is shorter):
- a document longer than a row is cut as it comes in: its first T+1 tokens, a row of their own, and the rest;
- leftovers come in pieces of at most (T+1) // 2 tokens, which fit the space that rows leave.
The tokens of leftovers are trained without their document's start: leftover_fraction() (pydocs, T=512: 17%,
nearly all of it the rest of documents longer than a row, which no row that starts at a BOS can hold). When
documents are on average about as long as a row or longer (every row starts one, so the rows cannot hold all
their tokens), the buffer fills up with leftovers; then the shortest one is dropped, counted in dropped_fraction().

Resuming. `loader.state_dict()` is a small dict (per slot: epoch, unit, document, token offset; best-fit:
the next document to read and the buffer's pieces as [epoch, unit, document, start, end]) giving the
position of the batch most recently returned; after load_state_dict() of it the loader returns that same
batch first, then continues exactly (the documents of the pieces are read and tokenized again). (The
training loop prefetches the next batch, so the batch it holds when it saves a checkpoint is the first one
the resumed run must see.) Slot states are keyed by slot, so the states of all ranks merge into one, and a
run can continue on any number of ranks.
"""

import math
import random
from bisect import bisect_left, bisect_right, insort
from collections import deque

import numpy as np
import torch

from nanochat.dataset import list_row_groups, read_row_group
from nanochat.output import UserError, print0

BESTFIT_BUFFER = 1000  # pieces of documents a best-fit (bos_aligned) slot chooses from


def grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size, show=False):
    """
    Micro-steps per optimizer step: total_batch_size / (device_batch_size x max_seq_len x world_size), which
    must be a whole number. If not, a UserError names the values and suggests ones that work. show: print the
    arithmetic (rank 0), as the training scripts do.
    """
    per_micro = device_batch_size * max_seq_len * world_size  # tokens of one micro-step on all ranks together
    if total_batch_size % per_micro == 0 and total_batch_size > 0:
        if show:
            print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = "
                   f"{device_batch_size * max_seq_len:,}")
            print0(f"Tokens / micro-batch (all {world_size} ranks): {per_micro:,}")
            print0(f"Total batch size {total_batch_size:,} => gradient accumulation steps: "
                   f"{total_batch_size // per_micro}")
        return total_batch_size // per_micro
    lower = total_batch_size // per_micro * per_micro
    options = [f"--total_batch_size={v}" for v in (lower, lower + per_micro) if v > 0]
    rows = [b for b in range(device_batch_size, 0, -1) if total_batch_size % (b * max_seq_len * world_size) == 0][:3]
    options += [f"--device_batch_size={b}" for b in rows]
    raise UserError(f"total_batch_size {total_batch_size:,} is not a multiple of device_batch_size x max_seq_len x "
                    f"world_size = {device_batch_size} x {max_seq_len} x {world_size} = {per_micro:,}; "
                    f"try {' or '.join(options)}")


def batch_to_device(inputs, targets, device):
    """
    A micro-batch on `device`: inputs int32 (contiguous), targets int64. To a GPU through page-locked staging memory,
    which lets the copy run asynchronously (non_blocking); the caching host allocator keeps each buffer alive until
    its copy has finished. Also the chat stages' packed loader's (nanochat/conversation_loader.py).
    """
    if device.type == "cuda":
        return (inputs.to(torch.int32).pin_memory().to(device, non_blocking=True),
                targets.to(torch.int64).pin_memory().to(device, non_blocking=True))
    return inputs.to(device, torch.int32).contiguous(), targets.to(device, torch.int64)


def _units(row_groups, num_slots):
    """Split the row groups into at least `num_slots` units: (row group index, j, k) = docs j::k."""
    k = max(1, -(-num_slots // len(row_groups)))
    return [(g, j, k) for g in range(len(row_groups)) for j in range(k)]


def _longest_up_to(keys, space):
    """The (length, seq) of the longest piece of at most `space` tokens in sorted `keys`, the earliest of equals."""
    i = bisect_right(keys, (space, math.inf)) - 1
    return keys[bisect_left(keys, (keys[i][0],))] if i >= 0 else None


class _BestFitBuffer:
    """
    The pieces a best-fit slot packs its rows from (see the module docstring). A piece is (where, tokens, start,
    end): tokens[start:end] of the document at where = (epoch, unit_pos, doc_idx). Pieces with start 0 begin
    with BOS and may begin a row; the others are leftovers. Each kind is kept sorted by (length, seq), seq
    counting the pieces in the order they came in, so every choice is a bisection, not a scan.
    """

    def __init__(self, width):
        self.width = width
        self.pieces = {}  # seq -> piece, in the order they came in
        self.starts = []
        self.leftovers = []
        self.seq = 0

    def __len__(self):
        return len(self.pieces)

    def put(self, piece):
        _, _, start, end = piece
        insort(self.starts if start == 0 else self.leftovers, (end - start, self.seq))
        self.pieces[self.seq] = piece
        self.seq += 1

    def add(self, where, tokens, start=0, end=None):
        """tokens[start:end] of a document as pieces: from its start, at most a row; the rest in leftovers."""
        end = len(tokens) if end is None else end
        if start == 0:
            self.put((where, tokens, 0, min(end, self.width)))
            start = min(end, self.width)
        step = self.width // 2
        for s in range(start, end, step):
            self.put((where, tokens, s, min(s + step, end)))

    def _remove(self, key):
        piece = self.pieces.pop(key[1])
        keys = self.starts if piece[2] == 0 else self.leftovers
        del keys[bisect_left(keys, key)]
        return piece

    def take(self, space, first):
        """The piece to put next in a row that has `space` tokens left (first: the row is empty), removed."""
        kinds = (self.starts,) if first else (self.starts, self.leftovers)
        fits = [key for keys in kinds if (key := _longest_up_to(keys, space))]
        if fits:
            return self._remove(max(fits, key=lambda key: (key[0], -key[1])))
        return self._remove(min(keys[0] for keys in kinds if keys))  # the shortest, to be cut

    def drop_leftover(self):
        """Remove the shortest leftover (the fewest tokens lost); returns its length."""
        _, _, start, end = self._remove(self.leftovers[0])
        return end - start


class _Slot:
    """
    One data slot of `loader` (its corpus, split, seed and tokenizer): its own position in the corpus and its own
    token buffer (best-fit: `width` = T+1), from `state` (a saved one) or the start.
    """

    def __init__(self, loader, slot, state=None):
        self.loader = loader
        self.slot = slot
        self.width = loader.width
        if self.width is None and isinstance(state, dict):
            raise UserError("this data position was saved by a run with bos_aligned=True: resume with bos_aligned=True")
        pieces = []
        if self.width is not None and state is not None:
            if not isinstance(state, dict):  # saved before best fit: a document start, nothing in a buffer
                state = {"next": state[:3], "pieces": []}
            pieces = state["pieces"]
            state = [*state["next"], 0]
        # reading position: the next document to tokenize is document `next_doc` of unit `unit_pos` of `epoch`
        self.epoch, self.unit_pos, self.next_doc, resume_offset = state if state is not None else (0, 0, 0, 0)
        self.my_units = self._epoch_units(self.epoch)
        self.unit_texts = None
        # token buffer: entries [epoch, unit_pos, doc_idx, tokens]; the first one is consumed up to self.offset
        # (best-fit: the documents read, whole, that have not yet gone into self.bestfit)
        self.docs = deque()
        self.offset = 0
        self.buffered = 0  # tokens in the buffer not yet consumed
        self.tokens_seen = 0
        self.tokens_dropped = 0
        self.tokens_placed = 0
        self.tokens_leftover = 0
        if resume_offset:
            self._refill()
            self.offset = resume_offset
            self.buffered -= resume_offset
        if self.width is not None:
            self.bestfit = _BestFitBuffer(self.width)
            self._load_pieces(pieces)

    def _epoch_units(self, epoch):
        loader = self.loader
        units = _units(loader.row_groups, loader.num_slots)
        if loader.split == "train":
            random.Random(f"{loader.seed}-{epoch}").shuffle(units)
        return units[self.slot::loader.num_slots]

    def snapshot(self):
        """Where this slot stands, cheaply: state() turns it into the saved form (small ints)."""
        if self.width is not None:
            position = tuple(self.docs[0][:3]) if self.docs else (self.epoch, self.unit_pos, self.next_doc)
            return position, list(self.bestfit.pieces.values())
        if self.docs:
            epoch, unit_pos, doc_idx, _ = self.docs[0]
            return (epoch, unit_pos, doc_idx, self.offset)
        return (self.epoch, self.unit_pos, self.next_doc, 0)

    def state(self, snapshot=None):
        """
        Stream: [epoch, unit, document, token offset] of the first token not yet returned. Best-fit: {"next":
        [epoch, unit, document] of the next document to read, "pieces": [[epoch, unit, document, start, end], ...]}.
        """
        snapshot = self.snapshot() if snapshot is None else snapshot
        if self.width is None:
            return list(snapshot)
        position, pieces = snapshot
        return {"next": list(position), "pieces": [[*where, start, end] for where, _, start, end in pieces]}

    def _load_pieces(self, pieces):
        """Rebuild a saved best-fit buffer: the documents its pieces come from are read and tokenized again."""
        units = {}
        texts = {}
        docs = {}
        for epoch, unit_pos, doc_idx, _, _ in pieces:
            if (epoch, unit_pos) not in texts:
                units.setdefault(epoch, self._epoch_units(epoch))
                g, j, k = units[epoch][unit_pos]
                texts[epoch, unit_pos] = read_row_group(*self.loader.row_groups[g])[j::k]
            docs[epoch, unit_pos, doc_idx] = texts[epoch, unit_pos][doc_idx]
        encoded = []
        if docs:
            encoded = self.loader.tokenize(list(docs.values()))
        tokens = {where: np.asarray(ids, dtype=np.int32) for where, ids in zip(docs, encoded)}
        for epoch, unit_pos, doc_idx, start, end in pieces:
            self.bestfit.put(((epoch, unit_pos, doc_idx), tokens[epoch, unit_pos, doc_idx], start, end))

    def _refill(self):
        """Tokenize the next few documents of this slot into the buffer."""
        if self.unit_texts is None:
            g, j, k = self.my_units[self.unit_pos]
            self.unit_texts = read_row_group(*self.loader.row_groups[g])[j::k]
        texts = self.unit_texts[self.next_doc:self.next_doc + self.loader.doc_batch]
        encoded = self.loader.tokenize(texts) if texts else []
        for i, ids in enumerate(encoded):
            self.docs.append([self.epoch, self.unit_pos, self.next_doc + i, np.asarray(ids, dtype=np.int32)])
            self.buffered += len(ids)
            self.tokens_seen += len(ids)
        self.next_doc += len(texts)
        if self.next_doc >= len(self.unit_texts):  # unit done: next unit, or next epoch
            self.unit_texts = None
            self.next_doc = 0
            self.unit_pos += 1
            if self.unit_pos == len(self.my_units):
                self.epoch += 1
                self.unit_pos = 0
                self.my_units = self._epoch_units(self.epoch)
                if self.loader.split == "train":
                    print0(f"Data slot {self.slot} (train): starting epoch {self.epoch}")
                elif self.epoch == 1:  # an evaluation stops here (losses.evaluate_bpb)
                    print0(f"Data slot {self.slot} (val): read to its end: the validation split is smaller than one "
                           f"evaluation, which counts it once")

    def take_tokens(self, n):
        """The next n+1 tokens; advances by n (the last token is also the first of the next call)."""
        while self.buffered < n + 1:
            self._refill()
        out = np.empty(n + 1, dtype=np.int32)
        filled = 0
        start = self.offset
        for entry in self.docs:
            chunk = entry[3][start:start + n + 1 - filled]
            out[filled:filled + len(chunk)] = chunk
            filled += len(chunk)
            start = 0
            if filled == n + 1:
                break
        remaining = n  # advance by n: drop fully consumed documents, move the offset into the next one
        while remaining >= len(self.docs[0][3]) - self.offset:
            remaining -= len(self.docs.popleft()[3]) - self.offset
            self.offset = 0
        self.offset += remaining
        self.buffered -= n
        return out

    def take_rows(self, rows):
        """Best-fit: `rows` rows of `width` tokens, each starting at a document start (BOS)."""
        width = self.width
        out = np.empty((rows, width), dtype=np.int32)
        for r in range(rows):
            filled = 0
            while filled < width:
                self._top_up()
                where, tokens, start, end = self.bestfit.take(width - filled, first=filled == 0)
                n = min(end - start, width - filled)
                out[r, filled:filled + n] = tokens[start:start + n]
                if n < end - start:  # cut to fill the row: the rest waits in the buffer
                    self.bestfit.add(where, tokens, start + n, end)
                if start > 0:
                    self.tokens_leftover += n
                filled += n
        self.tokens_placed += rows * width
        return out

    def _top_up(self):
        """Before each placement: BESTFIT_BUFFER pieces in the buffer, at least one of which can start a row."""
        while len(self.bestfit) < BESTFIT_BUFFER or not self.bestfit.starts:
            if len(self.bestfit) >= BESTFIT_BUFFER:  # full of leftovers: documents longer than rows, on average
                self.tokens_dropped += self.bestfit.drop_leftover()
                continue
            while not self.docs:
                self._refill()
            epoch, unit_pos, doc_idx, tokens = self.docs.popleft()
            self.bestfit.add((epoch, unit_pos, doc_idx), tokens)


class DistributedTokenLoader:
    """Iterator of (inputs, targets) micro-batches for one rank; see the module docstring."""

    def __init__(self, *, B, T, split, device, tokenizer, rank, world_size, total_batch_size=None, seed=0,
                 bos_aligned=False, tokenizer_threads=4, tokenizer_batch_size=128):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.B = B
        self.T = T
        self.split = split
        self.device = torch.device(device)
        self.bos_aligned = bos_aligned
        if total_batch_size is None:  # one slot per rank, e.g. for evaluation
            total_batch_size = B * T * world_size
        self.accum = grad_accum_steps_for(total_batch_size, B, T, world_size)  # micro-batches per rank per step
        self.num_slots = self.accum * world_size
        self.my_slots = list(range(rank * self.accum, (rank + 1) * self.accum))
        # The corpus is listed once, here: every epoch reads the same units (shards downloaded later are not
        # picked up mid-run, which keeps the data order reproducible)
        self.row_groups = list_row_groups(split)
        self.seed = seed
        self.tokenizer = tokenizer
        self.threads = tokenizer_threads
        self.doc_batch = tokenizer_batch_size  # documents a slot tokenizes at a time
        self.width = T + 1 if bos_aligned else None  # a best-fit row's tokens
        self.load_state_dict({"slots": {}, "micro": 0})

    def tokenize(self, texts):
        """The token ids of documents `texts`, each after a BOS, tokenized in parallel."""
        return self.tokenizer.encode(texts, prepend=self.tokenizer.get_bos_token_id(), num_threads=self.threads)

    def load_state_dict(self, state):
        """
        Continue from `state`: a state_dict() of a loader of the same settings, or the list of the state_dicts
        of every rank of the saving run (their slots are merged, so any number of ranks can continue).
        """
        states = state if isinstance(state, list) else [state]
        slot_states = {k: v for s in states for k, v in s["slots"].items()}
        self.slots = [_Slot(self, s, slot_states.get(str(s))) for s in self.my_slots]
        self.micro = states[0].get("micro", 0) % self.accum  # which of my slots serves the next batch
        self.last = None  # (slot index, snapshot of its state before the last returned batch)

    def __iter__(self):
        return self

    def __next__(self):
        i = self.micro
        slot = self.slots[i]
        self.last = (i, slot.snapshot())
        if self.bos_aligned:
            rows = slot.take_rows(self.B)
            inputs = torch.from_numpy(rows[:, :-1])
            targets = torch.from_numpy(rows[:, 1:])
        else:
            buf = torch.from_numpy(slot.take_tokens(self.B * self.T))
            inputs = buf[:-1].view(self.B, self.T)
            targets = buf[1:].view(self.B, self.T)
        self.micro = (self.micro + 1) % len(self.slots)
        return batch_to_device(inputs, targets, self.device)

    @property
    def epoch(self):
        return min(s.epoch for s in self.slots)

    def dropped_fraction(self):
        """The fraction of the tokens read that were dropped: 0, unless best-fit documents outgrow the rows."""
        seen = sum(s.tokens_seen for s in self.slots)
        return sum(s.tokens_dropped for s in self.slots) / max(seen, 1)

    def leftover_fraction(self):
        """
        Best-fit: the fraction of the tokens put in rows that continue a document begun elsewhere (leftovers),
        so are trained without their document's start.
        """
        placed = sum(s.tokens_placed for s in self.slots)
        return sum(s.tokens_leftover for s in self.slots) / max(placed, 1)

    def state_dict(self):
        """Position of the most recently returned batch (resuming returns it again first)."""
        states = {str(s.slot): s.state() for s in self.slots}
        micro = self.micro
        if self.last is not None:
            i, before = self.last
            states[str(self.slots[i].slot)] = self.slots[i].state(before)
            micro = i
        return {"slots": states, "micro": micro, "num_slots": self.num_slots, "split": self.split}


def tokenizing_distributed_data_loader(B, T, split, device="cpu", *, tokenizer, total_batch_size=None, seed=0,
                                       bos_aligned=False, tokenizer_threads=4):
    """
    Micro-batches of (B, T) tokens of `split` for this rank. `total_batch_size` (tokens per optimizer
    step across all ranks) defines the data slots; None means one slot per rank (evaluation).
    """
    from nanochat.processes import get_dist_info
    _, rank, _, world_size = get_dist_info()
    return DistributedTokenLoader(B=B, T=T, split=split, device=device, tokenizer=tokenizer, rank=rank,
                                  world_size=world_size, total_batch_size=total_batch_size, seed=seed,
                                  bos_aligned=bos_aligned, tokenizer_threads=tokenizer_threads)
