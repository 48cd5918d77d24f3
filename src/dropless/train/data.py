"""The text ``dropless train`` learns from: bytes as tokens, the built-in corpus, a train/held-out split
and random batches.

Tokens are the bytes of the UTF-8 text (a 256-symbol vocabulary): nothing to download or train. The
built-in corpus is the Python standard library's own source (code, comments and docstrings, about
11 MB on CPython 3.11), present on every Python install.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from dropless.train.errors import TrainError

BUILTIN_CORPUS = "python-stdlib"
HELD_OUT_FRACTION = 0.1
# Folders of the standard library left out of the built-in corpus: tests (deliberately odd text,
# invalid encodings) and third-party packages (they differ from one install to another).
_EXCLUDED_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages"})
_MIN_BUILTIN_BYTES = 1_000_000


def encode(text: str) -> torch.Tensor:
    """uint8 ``[len(utf-8 bytes)]``: the token ids of ``text``."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(tokens: torch.Tensor) -> str:
    """The text of token ids ``[N]`` (any integer dtype); bytes that are not valid UTF-8 become U+FFFD."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")  # sync-ok: text out


def stdlib_source() -> bytes:
    """The standard library's ``.py`` files (tests and site-packages left out), in an order shuffled
    with a fixed seed so that the held-out tail is a sample of modules, joined by blank lines."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if _EXCLUDED_DIRS.isdisjoint(p.relative_to(root).parts[:-1]))
    random.Random(0).shuffle(paths)
    texts = []
    for path in paths:
        try:
            raw = path.read_bytes()
            raw.decode("utf-8")  # files that are not UTF-8 text are left out
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(raw)
    source = b"\n\n".join(texts)
    if len(source) < _MIN_BUILTIN_BYTES:
        raise TrainError(f"the Python standard library's source in {root} holds only {len(source):,} bytes of "
                         "readable .py files (a stripped install?): train on your own text with --data FILE")
    return source


@dataclass(frozen=True)
class Corpus:
    """Token ids (uint8, on the CPU) split into a training part and a held-out tail.

    ``name`` is the file's path or ``python-stdlib``; ``fingerprint`` a hash of all the bytes, so
    that a resumed run can tell it is reading the same text.
    """

    name: str
    train: torch.Tensor
    held_out: torch.Tensor
    fingerprint: str

    @property
    def size(self) -> int:
        return self.train.numel() + self.held_out.numel()


def load_corpus(path: Path | None, seq_len: int) -> Corpus:
    """The corpus of ``path`` (any text file; its bytes), or the built-in one when ``path`` is None.

    The last ``HELD_OUT_FRACTION`` of the bytes (at least one window of ``seq_len + 1``) is held out.
    Raises TrainError for a missing or unreadable file, or a text too short for two windows.
    """
    if path is None:
        name, raw = BUILTIN_CORPUS, stdlib_source()
    else:
        name = str(path)
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            raise TrainError(f"--data {path}: no such file") from None
        except OSError as exc:
            raise TrainError(f"--data {path}: cannot read it ({exc.strerror or exc})") from None
    window = seq_len + 1
    held_out = max(window, int(len(raw) * HELD_OUT_FRACTION))
    if len(raw) - held_out < window:
        raise TrainError(f"{name} has {len(raw):,} bytes: too short for --seq-len {seq_len}, which needs at "
                         f"least {2 * window:,} ({window:,} to train on and {window:,} held out)")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    split = len(raw) - held_out
    return Corpus(name, tokens[:split], tokens[split:], hashlib.sha256(raw).hexdigest()[:16])


class BatchSampler:
    """Random windows of a token stream, drawn with a generator of its own (its state is checkpointed).

    Each step draws ``world_size * batch_size`` window starts and keeps this rank's slice of them, so
    ranks see different windows and the global batch does not depend on how it is split.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int,
                 device: torch.device, rank: int = 0, world_size: int = 1) -> None:
        self.tokens = tokens.to(device)
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.generator = torch.Generator().manual_seed(seed)
        self._window = torch.arange(seq_len + 1, device=device)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs, targets``: int64 ``[batch_size, seq_len]`` on the device, targets shifted by one token.
        No host sync."""
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.world_size * self.batch_size,),
                               generator=self.generator)
        mine = starts[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
        if self._window.is_cuda:  # a copy from pinned memory does not wait for the GPU to catch up
            mine = mine.pin_memory().to(self._window.device, non_blocking=True)
        windows = self.tokens[mine[:, None] + self._window].long()
        return windows[:, :-1], windows[:, 1:]

    def get_state(self) -> torch.Tensor:
        """The generator's state (uint8 tensor)."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
