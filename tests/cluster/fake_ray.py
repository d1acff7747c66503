"""A fake of the few Ray calls the driver makes: actors are plain objects whose calls run on threads
(`.remote()` returns at once, as Ray's does); object refs are futures.

Tests process. `FakeRay(substitutes)` builds the class given for an actor class it replaces (the
driver's `InstanceActor`, which would start a real instance: `Stops.instance_actor()`) and the real
class otherwise (the `Registry` is a plain class).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading

_ports = itertools.count(41000)


class Stops:
    """What the fake instances' `stop` calls do: each waits for `release` (bounded, as a slow
    instance finishing its streams would), and says when it began."""

    def __init__(self, max_s: float = 5.0):
        self.release = threading.Event()
        self.begun: list[str] = []  # urls, in the order their stop began
        self.max_s = max_s

    def instance_actor(self) -> type:
        stops = self

        class FakeInstanceActor:
            """An instance that serves at once (it takes `InstanceActor`'s arguments)."""

            def __init__(self, role: str, *args):
                self.role = role
                self.url = f"http://127.0.0.1:{next(_ports)}"

            def info(self) -> dict:
                return {"url": self.url, "host": "127.0.0.1", "alive": True, "state": "serving"}

            def stop(self, timeout_s: float = 60.0) -> None:
                stops.begun.append(self.url)
                stops.release.wait(stops.max_s)
        return FakeInstanceActor


class _Method:
    def __init__(self, pool, fn):
        self._pool, self._fn = pool, fn

    def remote(self, *args, **kw) -> concurrent.futures.Future:
        return self._pool.submit(self._fn, *args, **kw)


class Handle:
    """An actor handle: `handle.method.remote(...)`; `obj` is the actor itself."""

    def __init__(self, pool, obj):
        self.obj = obj
        self.killed = False
        self._pool = pool

    def __getattr__(self, name):
        return _Method(self._pool, getattr(self.obj, name))


class _ActorClass:
    def __init__(self, pool, cls):
        self._pool, self._cls = pool, cls

    def options(self, **kw) -> "_ActorClass":
        return self

    def remote(self, *args) -> Handle:
        return Handle(self._pool, self._cls(*args))


class FakeRay:
    def __init__(self, substitutes: dict[type, type]):
        self.substitutes = substitutes
        self.handles: list[Handle] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="fake-ray")

    def remote(self, cls) -> _ActorClass:
        return _ActorClass(self._pool, self.substitutes.get(cls, cls))

    def get(self, ref: concurrent.futures.Future, timeout: float | None = None):
        return ref.result(timeout)

    def wait(self, refs, num_returns: int, timeout: float):
        done, not_done = concurrent.futures.wait(refs, timeout)
        return list(done), list(not_done)

    def kill(self, handle: Handle, no_restart: bool = True) -> None:
        handle.killed = True

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
