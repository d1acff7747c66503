"""Native kernels, compiled on first use with the system C compiler and loaded with ctypes.

Every TP rank. A kernel that cannot be built (no compiler, another platform) is reported once and
the caller falls back to its PyTorch path: native code is an acceleration, never a requirement.
Builds are cached per source (with the shared headers), flags and CPU (they use -march=native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
_CACHE = Path(os.path.expanduser("~")) / ".cache" / "pdserve" / "kernels"
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}
MARCH = "native"  # what load() builds for: this CPU (bench/quant_kernels.py --march measures another's build)


def _cpuinfo(field: str) -> str:
    """The first /proc/cpuinfo line of `field` ("" where there is none)."""
    try:
        return next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith(field)), "")
    except OSError:
        return ""


def _cpu_tag() -> str:
    return f"{platform.machine()}|{_cpuinfo('model name')}|{_cpuinfo('flags')}"


def load(name: str, cpu_flags: tuple[str, ...] = (), march: str | None = None) -> ctypes.CDLL | None:
    """The compiled library for kernels/<name>.c, or None when it cannot be built here.
    `cpu_flags`: what the source needs (/proc/cpuinfo's names); a CPU without them skips the build.
    `march`: the CPU to build for, MARCH by default (`haswell`: the AVX2 build, which runs and can
    be tested on an AVX-512 CPU too)."""
    march = march or MARCH
    if (name, march) in _loaded:
        return _loaded[name, march]
    lib = None
    missing = [f for f in cpu_flags if f not in _cpuinfo("flags").split()]
    if missing:
        logger.info("native kernel %s not built: this CPU lacks %s; using the PyTorch path", name,
                    ", ".join(missing))
        _loaded[name, march] = None
        return None
    source = Path(__file__).with_name(f"{name}.c")
    compiler = shutil.which("cc") or shutil.which("gcc")
    flags = [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()
                         + _cpu_tag().encode())
    target = _CACHE / f"{name}-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            if compiler is None:
                raise RuntimeError("no C compiler found")
            _CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=_CACHE) as tmp:
                out = Path(tmp) / target.name
                command = [compiler, *flags, f"-I{source.parent}", "-o", str(out), str(source), "-lm"]
                subprocess.run(command, check=True, capture_output=True, timeout=120)
                os.replace(out, target)  # atomic: concurrent ranks never load a partial file
        lib = ctypes.CDLL(str(target))
    except Exception as e:  # noqa: BLE001 - fall back to PyTorch
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("native kernel %s unavailable (%s %s); using the PyTorch path", name, e,
                       detail.decode(errors="replace")[:500])
    _loaded[name, march] = lib
    return lib
