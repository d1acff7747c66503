"""Session fixtures: generated models (made once), engines (started once), and the correctness report."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import helpers  # noqa: E402


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> str:
    from pdserve.model.tiny import make_model
    return str(make_model(models_dir / "tiny", "tiny"))


@pytest.fixture(scope="session")
def tiny_kv1_model(models_dir) -> str:
    """One KV head: TP 2 replicates it on both ranks."""
    from pdserve.model.tiny import make_model
    return str(make_model(models_dir / "tiny-kv1", "tiny", num_kv_heads=1, seed=1))


_HF = {}


@pytest.fixture(scope="session")
def hf_checkpoint(models_dir, tiny_model):
    def get(kind: str) -> str:
        if kind not in _HF:
            _HF[kind] = str(helpers.write_hf_checkpoint(kind, models_dir / f"hf-{kind}",
                                                        Path(tiny_model)))
        return _HF[kind]
    return get


def _llm(model: str, tp: int, **kw):
    from pdserve import LLM
    return LLM(model, tensor_parallel_size=tp, num_threads=1, num_blocks=kw.pop("num_blocks", 256),
               **kw)


@pytest.fixture(scope="session")
def llm_tp1(tiny_model):
    llm = _llm(tiny_model, 1)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def llm_tp2(tiny_model):
    llm = _llm(tiny_model, 2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def make_llm():
    """Start an extra engine for one test; shut down at the end of the session."""
    started = []

    def make(model: str, tp: int = 1, **kw):
        llm = _llm(model, tp, **kw)
        started.append(llm)
        return llm
    yield make
    for llm in started:
        llm.shutdown()


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("greedy divergences at near-ties (docs/design.md, 'Correctness')")
    if helpers.DIVERGENCES:
        for line in helpers.DIVERGENCES:
            tr.write_line(line)
    tr.write_line(f"{len(helpers.DIVERGENCES)} comparisons diverged at a reference top-2 gap < "
                  f"{helpers.GAP_EPS}; every other comparison was token for token")
