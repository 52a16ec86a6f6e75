"""The demo's training text: the Python standard library's own source, as byte-level tokens.

Nothing is downloaded. The corpus is the top-level ``*.py`` files of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``), read in sorted file-name order and capped at
``MAX_BYTES``, so it is the same on every run of the same Python. Tokens are the raw UTF-8 bytes
(vocab 256). The first 90% of the bytes are the train split, the rest the held-out "val" split.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Optional, Union

import torch

__all__ = ["VOCAB_SIZE", "MAX_BYTES", "corpus_bytes", "tokens", "get_batch"]

VOCAB_SIZE = 256
MAX_BYTES = 4 * 1024 * 1024     # ~4 MB: plenty for a demo, reads in well under a second
TRAIN_FRACTION = 0.9
SPLITS = ("train", "val")


@functools.lru_cache(maxsize=1)
def corpus_bytes(max_bytes: int = MAX_BYTES) -> bytes:
    """The standard library's top-level sources, concatenated in sorted order, capped at max_bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise RuntimeError(f"no *.py files found under the standard library directory {stdlib}")
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file is skipped; the order of the others does not change
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


@functools.lru_cache(maxsize=len(SPLITS))
def tokens(split: str) -> torch.Tensor:
    """int64 [n] byte tokens of ``split`` ("train" or "val")."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).to(torch.int64)
    cut = int(len(data) * TRAIN_FRACTION)
    return data[:cut] if split == "train" else data[cut:]


def get_batch(split: str, batch_size: int, block_size: int,
              generator: Optional[torch.Generator] = None,
              device: Union[str, torch.device] = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), both int64 [batch_size, block_size]: random windows of ``split``, y shifted by one.

    The window starts come from ``generator`` (a CPU ``torch.Generator``), so the same seed gives
    the same batches on any device.
    """
    data = tokens(split)
    if block_size + 1 > len(data):
        raise ValueError(f"block_size={block_size} is longer than the {split!r} split ({len(data)} tokens)")
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    # [batch_size, block_size + 1] windows, then split into inputs and next-token targets
    windows = torch.stack([data[s:s + block_size + 1] for s in starts.tolist()])
    x, y = windows[:, :-1], windows[:, 1:]
    return x.contiguous().to(device), y.contiguous().to(device)
