"""dropless train's data: bytes as tokens, the held-out split, random windows per rank, the built-in corpus."""

from __future__ import annotations

import random

import pytest
import torch
from test_train import random_text

from dropless.train.data import BUILTIN_CORPUS, HELD_OUT_FRACTION, BatchSampler, decode, encode, load_corpus
from dropless.train.errors import TrainError


def test_encode_decode_round_trip():
    text = "".join(chr(random.choice([random.randint(32, 126), random.randint(0x400, 0x4FF), 0x1F600]))
                   for _ in range(200))
    tokens = encode(text)
    assert tokens.dtype == torch.uint8 and tokens.numel() == len(text.encode("utf-8"))
    assert decode(tokens) == text
    assert decode(tokens.long()) == text


@pytest.mark.parametrize("seq_len", [8, 64])
def test_the_tail_is_held_out(tmp_path, seq_len):
    path = random_text(tmp_path / "text.txt", random.randint(150, 400))
    raw = path.read_bytes()
    corpus = load_corpus(path, seq_len)
    assert corpus.held_out.numel() == max(seq_len + 1, int(len(raw) * HELD_OUT_FRACTION))
    assert bytes(torch.cat([corpus.train, corpus.held_out]).tolist()) == raw
    assert corpus.size == len(raw) and corpus.name == str(path)
    assert load_corpus(path, seq_len).fingerprint == corpus.fingerprint
    path.write_bytes(raw[::-1])
    assert load_corpus(path, seq_len).fingerprint != corpus.fingerprint


def test_the_shortest_text_that_fits(tmp_path):
    seq_len = random.randint(4, 40)
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(random.randrange(256) for _ in range(2 * (seq_len + 1))))
    corpus = load_corpus(path, seq_len)
    assert corpus.train.numel() == corpus.held_out.numel() == seq_len + 1
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(TrainError, match=f"needs at least {2 * (seq_len + 1)}"):
        load_corpus(path, seq_len)


def test_batches_are_windows_and_their_next_bytes():
    tokens = torch.randint(0, 256, (random.randint(100, 300),), dtype=torch.uint8)
    B, T = 5, 17
    sampler = BatchSampler(tokens, B, T, seed=random.randrange(2**31), device=torch.device("cpu"))
    inputs, targets = sampler.next_batch()
    assert inputs.shape == targets.shape == (B, T) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    text = tokens.long()
    for row, target in zip(inputs, targets):
        starts = [s for s in range(tokens.numel() - T) if torch.equal(text[s:s + T], row)]
        assert any(torch.equal(text[s + 1:s + T + 1], target) for s in starts)


def test_sampler_state_replays_the_batches():
    tokens = torch.randint(0, 256, (500,), dtype=torch.uint8)
    sampler = BatchSampler(tokens, 3, 10, seed=random.randrange(2**31), device=torch.device("cpu"))
    sampler.next_batch()
    state = sampler.get_state()
    expected = [sampler.next_batch() for _ in range(3)]
    sampler.set_state(state)
    for want in expected:
        got = sampler.next_batch()
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_ranks_split_one_global_batch():
    tokens = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    seed, B, T, world = random.randrange(2**31), 3, 12, 4
    cpu = torch.device("cpu")
    whole = BatchSampler(tokens, world * B, T, seed, cpu)
    parts = [BatchSampler(tokens, B, T, seed, cpu, rank, world) for rank in range(world)]
    for _ in range(3):
        inputs, targets = whole.next_batch()
        batches = [p.next_batch() for p in parts]
        assert torch.equal(torch.cat([b[0] for b in batches]), inputs)
        assert torch.equal(torch.cat([b[1] for b in batches]), targets)


def test_builtin_corpus_is_the_standard_library():
    corpus = load_corpus(None, 128)
    assert corpus.name == BUILTIN_CORPUS
    assert corpus.size > 1_000_000
    text = decode(corpus.train[:200_000])
    assert "def " in text and "import " in text and '"""' in text
    assert load_corpus(None, 128).fingerprint == corpus.fingerprint
