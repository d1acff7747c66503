"""The follower keeps an index exact when batches are lost, on a scripted stream (no sockets): a
lost last batch is found by the quiet check, or, lost after that check, once the publisher says it
sealed it."""

from __future__ import annotations

from pdserve.prefix_cache.events import BlockStored, EventBatch
from pdserve.prefix_cache.subscriber import KVEventFollower


def _batch(h: int) -> EventBatch:
    return EventBatch(ts=0.0, events=[BlockStored(block_hashes=[h], parent_block_hash=None,
                                                  token_ids=[1] * 4, block_size=4)])


class ScriptedStream:
    """A publisher's buffer and what of it reached the subscriber (`deliver`) or was lost (`lose`)."""

    def __init__(self):
        self.buffer: list[tuple[int, EventBatch]] = []
        self.arriving: list[tuple[str, int, EventBatch]] = []
        self.num_replays = 0

    def publish(self, h: int, lost: bool = False) -> int:
        seq = len(self.buffer)
        self.buffer.append((seq, _batch(h)))
        if not lost:
            self.arriving.append(("t", seq, _batch(h)))
        return seq

    def recv(self, timeout_s: float):
        return self.arriving.pop(0) if self.arriving else None

    def replay(self, start_seq: int, timeout_s: float = 5.0):
        self.num_replays += 1
        return [(seq, b) for seq, b in self.buffer if seq >= start_seq]


def _quiet(follower: KVEventFollower, polls: int = 3) -> None:
    for _ in range(polls):
        follower.poll(0.0)


def test_a_lost_last_batch_is_replayed_when_the_stream_goes_quiet():
    stream = ScriptedStream()
    follower = KVEventFollower(stream)
    stream.publish(1)
    stream.publish(2, lost=True)
    _quiet(follower)
    assert follower.index.hashes == {1, 2} and follower.num_gaps == 1
    _quiet(follower)
    assert stream.num_replays == 1  # one check per quiet spell


def test_a_batch_lost_after_the_quiet_check_is_replayed_once_the_publisher_names_it():
    stream = ScriptedStream()
    follower = KVEventFollower(stream)
    stream.publish(1)
    _quiet(follower)  # applied, then checked: nothing missed
    seq = stream.publish(2, lost=True)  # the stream's last batch, lost after the check
    _quiet(follower)
    assert follower.index.hashes == {1}  # nothing arrived to show the gap
    follower.published(seq)  # the instance's /health: last_seq
    _quiet(follower)
    assert follower.index.hashes == {1, 2} and follower.num_gaps == 1
    replays = stream.num_replays
    _quiet(follower)
    assert stream.num_replays == replays  # caught up: no more replays while quiet


def test_a_follower_started_on_an_idle_instance_catches_up_once_told_its_last_batch():
    stream = ScriptedStream()
    for h in range(3):
        stream.publish(h, lost=True)  # published before the follower connected
    follower = KVEventFollower(stream)
    _quiet(follower)
    assert follower.index.hashes == set()
    follower.published(2)
    _quiet(follower)
    assert follower.index.hashes == {0, 1, 2}
