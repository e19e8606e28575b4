"""
Files for exchanging models with other tools: safetensors read and written without the `safetensors` package,
and directories written all or nothing (staged_directory).

safetensors layout: an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}} (offsets count from the first byte after the header), then
the tensors' raw little-endian bytes, row-major. A large model may be split into several such files, listed by
model.safetensors.index.json ({"weight_map": {name: file}}).
"""

import contextlib
import errno
import json
import math
import os
import shutil
import tempfile

import torch

from nanochat.common import UserError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 2**20  # a header is JSON text about the tensors: more than this is not a safetensors file


def save_safetensors(tensors, path):
    """Write {name: tensor} to `path` (tensors stored as they are: cast them first)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}  # older readers insist on it
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().data)


def load_safetensors(path):
    """{name: tensor} of one safetensors file. Anything malformed is a UserError naming the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or not 2 <= n <= min(MAX_HEADER, size - 8):
            raise UserError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise UserError(f"{path} is not a safetensors file (its header is not JSON)") from None
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
            if dtype is None:
                raise UserError(f"{path}: tensor {name} has dtype {info.get('dtype') if isinstance(info, dict) else info!r}; "
                                f"readable: {', '.join(DTYPES)}")
            shape, (begin, end) = info["shape"], info["data_offsets"]
            count = math.prod(shape)
            if end - begin != count * dtype.itemsize or not 0 <= begin <= end <= size - 8 - n:
                raise UserError(f"{path}: tensor {name} does not fit the file (truncated?)")
            f.seek(8 + n + begin)
            buffer = bytearray(end - begin)
            if f.readinto(buffer) != len(buffer):
                raise UserError(f"{path}: tensor {name} is cut short (truncated file)")
            tensors[name] = torch.frombuffer(buffer, dtype=dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype)
    return tensors


def load_safetensors_dir(directory):
    """The weights of a directory: model.safetensors, or the files model.safetensors.index.json lists."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UserError(f"{index} is not a safetensors index (no weight_map)") from None
        missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
        if missing:
            raise UserError(f"{directory} lacks {', '.join(missing[:3])}, listed in model.safetensors.index.json")
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_safetensors(os.path.join(directory, name)))
    return tensors


# -----------------------------------------------------------------------------
# Directories written all or nothing


def check_free(target, overwrite, flag):
    """`target` may be written: absent, an empty directory, or (with overwrite) any directory. Else a UserError."""
    if os.path.exists(target) and not os.path.isdir(target):
        raise UserError(f"{flag}={target} is a file, not a directory")
    if os.path.isdir(target) and os.listdir(target) and not overwrite:
        raise UserError(f"{flag}={target} is not empty: choose another directory, or add --overwrite to replace it")


@contextlib.contextmanager
def staged_directory(target, overwrite, flag):
    """
    Yields a new temporary directory beside `target` to fill; when the block ends without an error it takes
    target's place (a rename, so readers see the old directory or the complete new one, never a half-written one).
    On any error it is removed and target is left as it was. A full disk or a read-only place is a UserError.
    """
    target = os.path.abspath(target)
    check_free(target, overwrite, flag)
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp", dir=parent)
    except OSError as e:
        raise UserError(f"cannot write {flag}={target}: {e.strerror}") from None
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        old = None
        if os.path.isdir(target) and os.listdir(target):  # --overwrite: move the old one aside, delete it last
            old = f"{tmp}.old"
            os.rename(target, old)
        try:
            os.rename(tmp, target)  # also replaces an empty directory
        except BaseException:
            if old:
                os.rename(old, target)
            raise
        if old:
            shutil.rmtree(old)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"cannot write {flag}={target} ({e.strerror}); nothing was changed there") from None
        raise
