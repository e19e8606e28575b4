"""
Bits per byte: the validation metric of pretraining.

Mean cross-entropy per token depends on the tokenizer (a bigger vocabulary packs more text into each
token, so each token is harder to predict). Bits per byte does not: it is the total loss, converted from
nats to bits, divided by the number of UTF-8 bytes the predicted tokens stand for:

    bpb = sum(loss of each target token, nats) / (ln 2 * sum(bytes of each target token))

Targets that are special tokens (0 bytes in token_bytes, e.g. <|bos|>) and ignored targets (-1) count in
neither sum. Under torchrun both sums are all-reduced, so every rank returns the bpb of all ranks' data.
"""

import math

import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes):
    """
    model(x, y, loss_reduction="none") -> per-token loss; `batches` yields (x, y); `steps` batches per rank;
    token_bytes: (vocab,) tensor of bytes per token id, on the model's device. Returns a float.
    """
    device = token_bytes.device
    acc_dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    total_nats = torch.zeros((), dtype=acc_dtype, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    batch_iter = iter(batches)
    for _ in range(steps):
        x, y = next(batch_iter)
        loss = model(x, y, loss_reduction="none").view(-1)
        y = y.view(-1)
        valid = y >= 0
        num_bytes = torch.where(valid, token_bytes[torch.where(valid, y, 0)], 0)
        total_nats += (loss * (num_bytes > 0)).sum().to(acc_dtype)
        total_bytes += num_bytes.sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    total_bytes = total_bytes.item()
    if total_bytes == 0:
        return float("inf")
    return total_nats.item() / (math.log(2) * total_bytes)
