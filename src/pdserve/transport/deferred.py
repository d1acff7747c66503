"""A side-channel reply that another thread gives later.

Any process. A side-channel handler answers most requests at once, on the server's thread; one that
needs the engine thread (a claim pins blocks in the engine's pool) returns a `Deferred` instead. The
server sends `resolve`'s reply when it comes, or `fallback` once `timeout_s` has passed: whichever
happens first wins, and `resolve` says whether its reply will be sent (if not, the resolver undoes
what it did for it).
"""

from __future__ import annotations

import threading
import time


class Deferred:
    def __init__(self, fallback: object, timeout_s: float, clock=time.monotonic):
        self.fallback = fallback
        self.deadline = clock() + timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._reply: object = None
        self._settled = False

    def resolve(self, reply: object) -> bool:
        """Give the reply; False when the fallback was already sent instead."""
        with self._lock:
            if self._settled:
                return False
            self._reply, self._settled = reply, True
            return True

    def result(self) -> object | None:
        """The reply to send now, or None while neither it nor the deadline has come."""
        with self._lock:
            if not self._settled:
                if self._clock() < self.deadline:
                    return None
                self._reply, self._settled = self.fallback, True
            return self._reply
