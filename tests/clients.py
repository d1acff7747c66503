"""Third-party clients (vllm-router, lm-eval, aiperf) for tests, each in a venv of its own under
~/.cache/pdserve-clients, made once and kept for later runs; a test skips, naming the package, only
when pip cannot install it."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

CLIENTS = Path.home() / ".cache" / "pdserve-clients"


def client_venv(requirement: str, probe: str, see_our_packages: bool = False, timeout_s: float = 900) -> Path:
    """The venv holding `requirement` (e.g. "aiperf==0.13.0"); `probe` is Python that must run in it
    (e.g. "import aiperf") for a kept venv to count as made. `see_our_packages`: the venv also sees
    this venv's packages (a .pth file) and torch is pinned to the installed build, so pip never
    fetches another (a CUDA) torch."""
    name = requirement.split("[")[0].split("==")[0] + "-" + requirement.split("==")[-1]
    venv = CLIENTS / name
    python = venv / "bin" / "python"
    if python.exists():
        if see_our_packages:  # this venv's, not the one that made it (a clone since deleted)
            _see_our_packages(python)
        if subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0:
            return venv
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        if see_our_packages:
            import torch
            _see_our_packages(python)
            constraints = venv / "constraints.txt"
            constraints.write_text(f"torch=={torch.__version__}\n")
            pip += ["-c", str(constraints)]
        subprocess.run([*pip, requirement], check=True, capture_output=True, timeout=timeout_s)
        subprocess.run([str(python), "-c", probe], check=True, capture_output=True, timeout=120)
    except (subprocess.SubprocessError, OSError) as e:
        out = getattr(e, "stderr", b"") or b""
        pytest.skip(f"pip could not install {requirement}: {e} {out.decode(errors='replace')[-500:]}")
    return venv


def _see_our_packages(python: Path) -> None:
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()
    (Path(site) / "pdserve-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
