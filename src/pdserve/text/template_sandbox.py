"""Chat templates a request brings, rendered in a child process that can be stopped (docs/design.md,
"Checkpoints and chat").

Server process (`TemplateSandbox`, called from worker threads) and its renderer child (`python -m
pdserve.text.template_sandbox`). The child renders one template at a time under an address-space
limit and a CPU-time limit per render, stops as soon as the output passes `max_chars`, and keeps
compiled templates in an LRU. The server waits `timeout_s` for an answer, then kills the child; the
next render starts a new one. The child exits when its stdin closes (the server stopped or died).
Frames on the pipes: a 4-byte big-endian length, then a msgspec JSON message.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import select
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec

from pdserve.text.chat_template import TEMPLATE_CACHE_SIZE, ChatTemplateError, describe, environment, render_text

RENDER_TIMEOUT_S = 2.0  # a chat template renders in milliseconds
MEMORY_BYTES = 512 << 20  # the child's address space
START_TIMEOUT_S = 30.0  # a new child imports jinja2 (a fraction of a second on an idle core)
WAIT_S = 5.0  # for another request's render to end, then 503


class TemplateBusyError(RuntimeError):
    """Other requests' templates kept the renderer busy for longer than `wait_s`."""


class RenderRequest(msgspec.Struct):
    source: str
    context: dict[str, Any]
    max_chars: int


class RenderReply(msgspec.Struct):
    text: str | None = None
    error: str | None = None


_request_decoder = msgspec.json.Decoder(RenderRequest)
_reply_decoder = msgspec.json.Decoder(RenderReply)


class TemplateSandbox:
    """Renders request-supplied templates in the child, one at a time; thread-safe."""

    def __init__(self, timeout_s: float = RENDER_TIMEOUT_S, memory_bytes: int = MEMORY_BYTES,
                 wait_s: float = WAIT_S):
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def render(self, source: str, context: dict, max_chars: int) -> str:
        """The template's text; ChatTemplateError (naming `chat_template`) when it fails, runs out
        of time or memory, or would be longer than `max_chars`."""
        if not self._lock.acquire(timeout=self.wait_s):
            raise TemplateBusyError(f"request chat templates kept the renderer busy for {self.wait_s:.0f} s")
        try:
            reply = self._exchange(RenderRequest(source, context, max_chars), max_chars)
        finally:
            self._lock.release()
        if reply.error is not None:
            raise ChatTemplateError(reply.error, "chat_template")
        return reply.text

    def close(self) -> None:
        with self._lock:
            self._stop()

    # --- under the lock -----------------------------------------------------------------------

    def _exchange(self, request: RenderRequest, max_chars: int) -> RenderReply:
        proc = self._proc or self._start()
        deadline = time.monotonic() + self.timeout_s
        try:
            _send(proc.stdin.fileno(), msgspec.json.encode(request), deadline)
            raw = _receive(proc.stdout.fileno(), deadline, 4 * max_chars + 4096)
        except TimeoutError:
            self._stop()
            return RenderReply(error=f"the chat template took longer than {self.timeout_s:g} s to render")
        except OSError as e:  # the child died (CPU limit, a crash) or its answer made no sense
            self._stop()
            return RenderReply(error=f"the chat template's renderer stopped: {e}")
        return _reply_decoder.decode(raw)

    def _start(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "pdserve.text.template_sandbox", str(self.memory_bytes),
               str(math.ceil(self.timeout_s) + 1)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        for pipe in (self._proc.stdin, self._proc.stdout):
            os.set_blocking(pipe.fileno(), False)
        try:
            _receive(self._proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S, 16)  # ready
        except (OSError, TimeoutError) as e:
            self._stop()
            raise RuntimeError(f"the chat template renderer did not start: {e}") from None
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc.stdin.close()
            self._proc.stdout.close()
            self._proc = None


def _send(fd: int, body: bytes, deadline: float) -> None:
    data = memoryview(len(body).to_bytes(4, "big") + body)
    while data:
        if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
            raise TimeoutError
        try:
            data = data[os.write(fd, data):]
        except BlockingIOError:
            continue


def _receive(fd: int, deadline: float, max_bytes: int) -> bytes:
    size = int.from_bytes(_read(fd, 4, deadline), "big")
    if size > max_bytes:
        raise OSError(f"an answer of {size} bytes")
    return _read(fd, size, deadline)


def _read(fd: int, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError
        try:
            chunk = os.read(fd, n - len(out))
        except BlockingIOError:
            continue
        if not chunk:
            raise OSError("it exited")
        out += chunk
    return bytes(out)


# --- the child --------------------------------------------------------------------------------

def _serve(memory_bytes: int, cpu_s: int) -> None:
    """Answer render requests from stdin until it closes."""
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # a stray print cannot corrupt a frame
    inp = sys.stdin.buffer
    compile_template = functools.lru_cache(maxsize=TEMPLATE_CACHE_SIZE)(environment().from_string)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out.write(b"\0\0\0\0")  # ready
    while len(head := inp.read(4)) == 4:
        request = _request_decoder.decode(inp.read(int.from_bytes(head, "big")))
        used = resource.getrusage(resource.RUSAGE_SELF)
        resource.setrlimit(resource.RLIMIT_CPU,  # the backstop when the server is gone mid-render
                           (math.ceil(used.ru_utime + used.ru_stime) + cpu_s, resource.RLIM_INFINITY))
        body = msgspec.json.encode(_render(compile_template, request, memory_bytes))
        out.write(len(body).to_bytes(4, "big") + body)


def _render(compile_template, request: RenderRequest, memory_bytes: int) -> RenderReply:
    try:
        template = compile_template(request.source)
    except Exception as e:  # noqa: BLE001 - whatever the parser raises
        return RenderReply(error=f"the chat template does not compile: {describe(e)}")
    try:
        return RenderReply(text=render_text(template, request.context, request.max_chars))
    except MemoryError:
        return RenderReply(error=f"the chat template needs more than {memory_bytes >> 20} MiB of memory")
    except Exception as e:  # noqa: BLE001 - a template runs arbitrary expressions
        return RenderReply(error=describe(e))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
