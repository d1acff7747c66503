"""Content hashes of KV blocks: the documented algorithm, and the same in every process."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import pytest

from pdserve.prefix_cache.hashing import (HASH_SEED, ROOT_HASH, block_hash, event_hash, extra_keys, hash_blocks,
                                          prompt_event_hashes)

MODEL = "m0:float32:2:2:16:16:HND"


def _by_hand(parent: bytes, tokens: list[int], keys: list[str]) -> bytes:
    """docs/design.md, "Prefix cache: hashes and KV events", written out independently."""
    raw = parent + struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
    raw += struct.pack("<I", len(keys))
    for k in keys:
        raw += struct.pack("<I", len(k.encode())) + k.encode()
    return hashlib.sha256(raw).digest()


def test_block_hash_is_the_documented_encoding():
    assert ROOT_HASH == hashlib.sha256(HASH_SEED.encode()).digest()
    tokens = list(range(100, 140))  # two full blocks of 16 and a partial one
    digests = hash_blocks(tokens, 16, extra_keys(MODEL, "tenant-a"))
    first = _by_hand(ROOT_HASH, tokens[:16], [MODEL, "tenant-a"])
    assert digests == [first, _by_hand(first, tokens[16:32], [MODEL, "tenant-a"])]
    assert block_hash(first, tokens[16:32], (MODEL, "tenant-a")) == digests[1]
    assert event_hash(first) == int.from_bytes(first[-8:], "big") < 2 ** 64


def test_every_hash_depends_on_the_prefix_the_model_and_the_salt():
    tokens = list(range(64))
    base = hash_blocks(tokens, 16, extra_keys(MODEL))
    assert len(base) == 4 and len(hash_blocks(tokens[:63], 16, extra_keys(MODEL))) == 3
    edited = hash_blocks([7] + tokens[1:], 16, extra_keys(MODEL))
    assert not set(base) & set(edited)  # a change in block 0 changes every later block
    for keys in (extra_keys(MODEL, "s"), extra_keys("another-model")):
        assert not set(base) & set(hash_blocks(tokens, 16, keys))
    # keys are length-prefixed: ("ab", "c") is not ("a", "bc")
    assert hash_blocks(tokens, 16, ("ab", "c")) != hash_blocks(tokens, 16, ("a", "bc"))


def test_token_ids_out_of_range_are_refused():
    with pytest.raises(ValueError, match="token ids"):
        hash_blocks([-1] * 16, 16, extra_keys(MODEL))


_CHILD = """
import json, random, sys
from pdserve.prefix_cache.hashing import prompt_event_hashes
rng = random.Random(20260)
prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 400))] for _ in range(1000)]
salts = [None if i % 3 else f"salt-{i % 7}" for i in range(1000)]
print(json.dumps([prompt_event_hashes(p, 16, sys.argv[1], s) for p, s in zip(prompts, salts)]))
"""


def test_hashes_agree_across_processes_and_hash_seeds():
    """1,000 prompts (some salted) hashed in three processes with different PYTHONHASHSEED."""
    runs = []
    for seed in ("0", "1", "random"):
        out = subprocess.run([sys.executable, "-c", _CHILD, MODEL], check=True, capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONHASHSEED": seed})
        runs.append(json.loads(out.stdout))
    assert sum(len(h) for h in runs[0]) > 10_000
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][1] == prompt_event_hashes(_prompts()[1], 16, MODEL)  # and in this process


def _prompts():
    import random
    rng = random.Random(20260)
    return [[rng.randrange(50_000) for _ in range(rng.randrange(1, 400))] for _ in range(1000)]
