"""Which grammar library pdserve's structured outputs use, measured on this CPU: xgrammar,
llguidance and outlines-core side by side, each with the generated model's vocabulary and SmolLM2's.

    .venv/bin/python bench/grammar_libs.py [--libs xgrammar,llguidance,outlines_core]

Per library and vocabulary: import time, the tokenizer's preparation (once per process), a JSON
schema's compile (once per schema: cached), and the per-step bitmask fill of 8 matchers (batch 8)
walking a valid document token by token (median over the document's steps, 8 rows together). The
libraries are installed with `pip install --no-deps` for this comparison; only the chosen one is a
dependency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                       "tags": ["math", "engines", "poetry"],
                       "address": {"city": "London", "zip": "W1"}, "active": True},
                      separators=(",", ":"))
BATCH = 8


def import_seconds(lib: str) -> float:
    """In a fresh interpreter: what the first structured request would pay."""
    code = f"import time; t = time.perf_counter(); import {lib}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


class XGrammar:
    def __init__(self, model_dir: Path, eos: int):
        import xgrammar as xgr
        self.xgr = xgr
        tok_json = (model_dir / "tokenizer.json").read_text()
        vocab = json.loads(tok_json)["model"]["vocab"]
        encoded = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        added = {a["id"]: a["content"] for a in json.loads(tok_json).get("added_tokens", [])}
        encoded += [added[i] for i in range(len(encoded), max(added, default=-1) + 1)]
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok_json)
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"], stop_token_ids=[eos],
                                 add_prefix_space=meta["add_prefix_space"])
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self):
        return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def matchers(self, compiled):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(BATCH)]

    def bitmask(self):
        return self.xgr.allocate_token_bitmask(BATCH, self.vocab_size)

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matchers, token: int):
        for m in matchers:
            assert m.accept_token(token)


class LLGuidance:
    def __init__(self, model_dir: Path, eos: int):
        import llguidance
        import llguidance.torch
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=eos)
        self.vocab_size = self.tokenizer.vocab_size

    def compile(self):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        self.llg.LLMatcher(self.tokenizer, grammar)  # the first matcher compiles; later ones share it
        return grammar

    def matchers(self, grammar):
        return [self.llg.LLMatcher(self.tokenizer, grammar) for _ in range(BATCH)]

    def bitmask(self):
        return self.llg.torch.allocate_token_bitmask(BATCH, self.vocab_size)

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.llg.torch.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, matchers, token: int):
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class OutlinesCore:
    def __init__(self, model_dir: Path, eos: int):
        import outlines_core
        self.oc = outlines_core
        vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
        byte_decoder = _gpt2_byte_decoder()
        tokens: dict[bytes, list[int]] = {}
        for text, i in vocab.items():
            if i != eos:
                tokens.setdefault(bytes(byte_decoder[c] for c in text), []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.vocab_size = max(vocab.values()) + 1

    def compile(self):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
        return self.oc.Index(regex, self.vocabulary)

    def matchers(self, index):
        return [self.oc.Guide(index) for _ in range(BATCH)]

    def bitmask(self):
        import torch
        return torch.zeros(BATCH, (self.vocab_size + 31) // 32, dtype=torch.int32)

    def fill(self, guides, bitmask):
        for i, g in enumerate(guides):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def accept(self, guides, token: int):
        for g in guides:
            g.advance(token)


def _gpt2_byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


LIBS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def measure(lib: str, model_dir: Path) -> dict:
    from pdserve.text.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    doc_ids = tok.encode(DOCUMENT, add_special_tokens=False)
    start = time.perf_counter()
    backend = LIBS[lib](model_dir, tok.eos_token_id)
    prepare_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = backend.compile()
    compile_s = time.perf_counter() - start
    bitmask = backend.bitmask()
    runs, worst = [], []
    for _ in range(3):
        matchers, steps = backend.matchers(compiled), []
        for t in doc_ids:
            s = time.perf_counter()
            backend.fill(matchers, bitmask)
            steps.append(time.perf_counter() - s)
            allowed = (int(bitmask[0, t // 32]) >> (t % 32)) & 1
            assert allowed, f"{lib} masks the document's token {t}"
            backend.accept(matchers, t)
        runs.append(statistics.median(steps))
        worst.append(sorted(steps)[int(0.9 * len(steps))])
    return {"prepare_tokenizer_ms": round(prepare_s * 1e3, 1), "compile_schema_ms": round(compile_s * 1e3, 1),
            "fill_batch8_us_p50": round(min(runs) * 1e6, 1),
            "fill_batch8_us_p90": round(min(worst) * 1e6, 1), "document_tokens": len(doc_ids),
            "vocab_size": backend.vocab_size}


def model_dirs() -> dict[str, Path]:
    from pdserve.checkpoints.gguf_file import checkpoint_dir
    from pdserve.cli import pdserve_home
    from pdserve.model.tiny import make_model
    sys.path.insert(0, str(Path(__file__).parent))
    from engine import smollm2_file
    tiny = make_model(Path(tempfile.mkdtemp()) / "tiny", "tiny")
    return {"tiny": Path(tiny), "smollm2": Path(checkpoint_dir(smollm2_file(), pdserve_home() / "gguf"))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "grammar_libs.json"))
    args = ap.parse_args()
    dirs = model_dirs()
    results = {}
    for lib in args.libs.split(","):
        results[lib] = {"import_s": round(import_seconds(lib), 2)}
        for name, d in dirs.items():
            results[lib][name] = measure(lib, d)
            print(lib, name, results[lib][name], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
