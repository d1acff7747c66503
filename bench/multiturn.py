"""Multi-turn reuse through 1P1D (issue 20's target workload), beside the code before it (1eef903).

    .venv/bin/python bench/multiturn.py [--conversations 4] [--turns 6] [--quick] [--no-baseline]

Each conversation: a 512-token system prompt, 64-token user turns and 64-token greedy answers
(`ignore_eos`), token-id prompts through the proxy: turn k's prompt is turn k-1's prompt, its answer's
token ids (`return_token_ids`) and 64 new user tokens. Streamed; TTFT and the time to the second
token are taken by this client. Per turn, from each instance's /metrics before and after: the blocks
and bytes decode READ, the blocks the producer pulled from decode's cache instead of computing them,
the prompt tokens the producer computed, prefix-cache hits on each side ("n/a" where the code does
not export a counter; bytes are shown as blocks of `bytes_per_block`).

Two modes: (a) plain; (b) the producer's prefix cache reset before every turn (as after an
eviction): `POST /reset_prefix_cache` on the producer. The code before this work has no such route,
so its mode (b) runs a second deployment whose producer has `--no-prefix-caching`: it computes every
prompt whole, which is what a producer whose cache was reset before each turn does (the old decode
never reuses anything, in either mode). Every (mode, conversation) has its own prompts; the new and
the old code get the same ones, conversation by conversation in turn. Every answer is checked
against one colocated instance's greedy answer to the same prompt.

Code: each side runs from a git worktree of its ref (`--new-ref`, default HEAD; `--old-ref`,
default 1eef903) put first on PYTHONPATH (the venv's editable install comes after it); `--new-ref
installed` runs the installed code as it is. The JSON names the commit and path that ran.
P on core 0 and D on core 1, one thread each; the colocated instance on core 0, one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multiturn_report import report, summarize  # noqa: E402

from pdserve.bench.machine import busy_cores  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Deployment, Instance  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--num-blocks", "512", "--max-num-batched-tokens", "2048"]
BLOCK_SIZE = 16  # the default, for both codes
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 512, 64, 64
DECODE_METRICS = {"blocks_read": "pdserve:kv_blocks_read_total",
                  "blocks_read_skipped": "pdserve:kv_blocks_read_skipped_total",
                  "bytes_read": "pdserve:nixl_bytes_transferred_sum",
                  "prefix_cache_hits": "pdserve:prefix_cache_hits_total"}
PRODUCER_METRICS = {"prompt_tokens_computed": "pdserve:prompt_tokens_computed_total",
                    "prefix_cache_hits": "pdserve:prefix_cache_hits_total",
                    "blocks_pulled": "pdserve:kv_blocks_pulled_total",  # READ from decode's cache
                    "bytes_read": "pdserve:nixl_bytes_transferred_sum"}


# --- code under test ------------------------------------------------------------------------------

def checkout(ref: str, parent: Path) -> tuple[dict, dict]:
    """(env to run `ref`'s code, what ran): a detached git worktree of `ref` first on PYTHONPATH,
    or the installed code for "installed"."""
    env = {}
    if ref != "installed":
        path = parent / f"pdserve-{ref}"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), ref],
                       check=True, capture_output=True)
        env = {"PYTHONPATH": str(path / "src")}
    where = subprocess.run([sys.executable, "-c", "import pdserve; print(pdserve.__file__)"],
                           env={**os.environ, **env}, check=True, capture_output=True, text=True)
    src = Path(where.stdout.strip()).parent.parent
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                           capture_output=True, text=True).stdout.splitlines()
    return env, {"ref": ref, "commit": commit, "pdserve": str(src / "pdserve"),
                 "uncommitted_files": len(dirty)}


def usage(env: dict, command: str) -> str:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", command, "--help"], env={**os.environ, **env},
                          capture_output=True, text=True).stdout


def proxy_args(env: dict, routing: str = "least-loaded") -> list[str]:
    """By default every turn goes through P/D: a proxy routing by cache (`--routing kv-aware`, its
    default) prefills a turn decode lacks little of on decode itself (`--routing kv-aware` here
    measures that: what a deployment with pdserve's defaults does)."""
    return ["--routing", routing] if "--routing" in usage(env, "proxy") else []


def drop_unknown_flags(dep: Deployment, env: dict) -> list[str]:
    """This checkout's launcher adds flags older code lacks (KV events, the proxy's tokenizer):
    drop each flag (and its value) the code under test does not know; returns what was dropped."""
    dropped = []

    def keep(args: list[str], known: str) -> list[str]:
        out, i = [], 0
        while i < len(args):
            if args[i].startswith("--") and f"{args[i].split('=')[0]} " not in known + " ":
                value = i + 1 < len(args) and not args[i + 1].startswith("--") and "=" not in args[i]
                dropped.append(" ".join(args[i:i + 1 + value]))
                i += 1 + value
            else:
                out.append(args[i])
                i += 1
        return out
    serve = usage(env, "serve").replace("\n", " ").replace(",", " ").replace("]", " ")
    for inst in dep.instances:
        inst.args = keep(inst.args, serve)
    proxy = usage(env, "proxy").replace("\n", " ").replace(",", " ").replace("]", " ")
    dep.proxy_args = keep(dep.proxy_args, proxy)
    return sorted(set(dropped))


def remove_worktrees(parent: Path) -> None:
    for path in parent.glob("pdserve-*"):
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       capture_output=True)


# --- one turn -------------------------------------------------------------------------------------

def scrape(client: httpx.Client, url: str, names: dict[str, str]) -> dict[str, float | None]:
    """The named metrics' sums over label sets; None where the instance does not export one."""
    sums: dict[str, float] = {}
    for line in client.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    # a histogram appears with its first observation (both codes have the transfer ones)
    return {key: sums.get(name, 0.0 if name.endswith("_sum") else None) for key, name in names.items()}


def delta(before: dict, after: dict) -> dict:
    return {k: None if before[k] is None or after[k] is None else after[k] - before[k] for k in before}


def stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: its answer's token ids, TTFT, second token, end to end."""
    start = time.perf_counter()
    times, ids = [], []
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        decision = r.headers.get("x-pd-decision")  # the proxy's: remote (P/D) or local
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                for t in choice.get("token_ids") or []:
                    times.append(time.perf_counter() - start)
                    ids.append(t)
    if len(ids) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, streamed {len(ids)}")
    return {"answer": ids, "pd_decision": decision, "ttft_ms": times[0] * 1e3, "tt2t_ms": times[1] * 1e3 if len(times) > 1 else None,
            "e2e_ms": (time.perf_counter() - start) * 1e3}


def conversation(client: httpx.Client, dep: Deployment, reset: bool, seed: int, turns: int,
                 vocab: int) -> list[dict]:
    rng = random.Random(seed)
    new = [1] + [rng.randrange(7, vocab) for _ in range(SYSTEM_TOKENS + USER_TOKENS - 1)]
    prompt, held, records = [], 0, []
    p_url, d_url = dep.prefill[0].url, dep.decode[0].url
    for turn in range(1, turns + 1):
        prompt = prompt + new
        if reset:
            client.post(p_url + "/reset_prefix_cache").raise_for_status()
        p0, d0 = scrape(client, p_url, PRODUCER_METRICS), scrape(client, d_url, DECODE_METRICS)
        out = stream(client, dep.proxy.url, prompt, ANSWER_TOKENS)
        p1, d1 = scrape(client, p_url, PRODUCER_METRICS), scrape(client, d_url, DECODE_METRICS)
        records.append({"turn": turn, "prompt_tokens": len(prompt), "new_tokens": len(new),
                        "user_tokens": len(prompt) if turn == 1 else USER_TOKENS,
                        "decode_blocks_lacked": -(-len(prompt) // BLOCK_SIZE) - held,
                        **{k: out[k] for k in ("pd_decision", "ttft_ms", "tt2t_ms", "e2e_ms")},
                        "decode": delta(d0, d1), "producer": delta(p0, p1),
                        "prompt": prompt, "answer": out["answer"]})
        # decode keeps the prompt and the answer but the answer's last token (never computed)
        held = (len(prompt) + ANSWER_TOKENS - 1) // BLOCK_SIZE
        new = out["answer"] + [rng.randrange(7, vocab) for _ in range(USER_TOKENS)]
    return records


# --- the run --------------------------------------------------------------------------------------

def colocated_answers(client: httpx.Client, url: str, runs: dict) -> list[dict]:
    """Every turn's answer against the colocated instance's greedy answer to the same prompt."""
    mismatches, cache = [], {}
    for code, modes in runs.items():
        for mode, convs in modes.items():
            for c, records in enumerate(convs):
                for r in records:
                    key = tuple(r["prompt"])
                    if key not in cache:
                        body = {"prompt": r["prompt"], "max_tokens": ANSWER_TOKENS, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True, "logprobs": 2}
                        cache[key] = client.post(url + "/v1/completions", json=body).json()["choices"][0]
                    ref = cache[key]
                    r["matches_colocated"] = ref["token_ids"] == r["answer"]
                    if not r["matches_colocated"]:
                        i = next(i for i, (a, b) in enumerate(zip(ref["token_ids"], r["answer"])) if a != b)
                        top = sorted(ref["logprobs"]["top_logprobs"][i].values(), reverse=True)
                        mismatches.append({"code": code, "mode": mode, "conversation": c, "turn": r["turn"],
                                           "first_diff_token": i, "colocated_top2_gap": top[0] - top[1]})
    return mismatches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated `small`)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="one conversation of three turns")
    ap.add_argument("--new-ref", default="HEAD", help="git ref of the new code, or `installed`")
    ap.add_argument("--old-ref", default="1eef903")
    ap.add_argument("--no-baseline", action="store_true", help="run the new code only")
    ap.add_argument("--routing", default="least-loaded", choices=["least-loaded", "kv-aware"],
                    help="the new code's proxy routing: least-loaded sends every turn through P/D; "
                         "kv-aware (pdserve's default) prefills a turn on decode when decode holds its history")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "multiturn.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.turns = 1, 3
    model = ensure_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-multiturn-"))
    codes = {"new": args.new_ref} if args.no_baseline else {"new": args.new_ref, "old": args.old_ref}
    busy = busy_cores()
    results = {"model": model, "conversations": args.conversations, "turns": args.turns,
               "system_tokens": SYSTEM_TOKENS, "user_tokens": USER_TOKENS, "answer_tokens": ANSWER_TOKENS,
               "block_size": BLOCK_SIZE, "background_busy_cores": busy and round(busy, 2),
               "mode_b": "new: POST /reset_prefix_cache on the producer before every turn; old (no such "
                         "route): a producer started with --no-prefix-caching, which likewise computes "
                         "every prompt whole", "code": {}}
    deps, colo = {}, None
    try:
        envs = {}
        for code, ref in codes.items():
            envs[code], results["code"][code] = checkout(ref, tmp)
            results["code"][code]["proxy_args"] = proxy_args(envs[code], args.routing)
            info = results["code"][code]
            print(f"{code}: pdserve {info['commit']} (+{info['uncommitted_files']} uncommitted files) "
                  f"from {info['pdserve']}", flush=True)
        for code in codes:
            for mode in ("a", "b") if code == "old" else ("a",):
                role_args = {"prefill": ["--no-prefix-caching"]} if mode == "b" else None
                dep = Deployment(model, [1], [1], instance_args=ARGS, prefill_cpus=[(0,)], decode_cpus=[(1,)],
                                 log_dir=str(tmp / "logs"), env=envs[code], role_args=role_args,
                                 proxy_args=results["code"][code]["proxy_args"])
                results["code"][code]["flags_dropped"] = drop_unknown_flags(dep, envs[code])
                deps[code, mode] = dep.start()
        if "new" in codes:
            deps["new", "b"] = deps["new", "a"]
        colo = Instance("colocated", ["serve", model, "--port", "0", "--num-threads", "1", "--cpus", "0",
                                      *ARGS], cpus=(0,)).spawn(tmp / "logs", envs["new"]).wait_healthy()
        runs = {code: {"a": [], "b": []} for code in codes}
        with httpx.Client(timeout=600) as client:
            for i, dep in enumerate({id(d): d for d in deps.values()}.values()):  # handshakes, warm-up
                stream(client, dep.proxy.url, [1] + [7 + i] * 40, 4)
            for c in range(args.conversations):
                for mode in ("a", "b"):
                    for code in codes:
                        runs[code][mode].append(conversation(client, deps[code, mode],
                                                             reset=(code, mode) == ("new", "b"),
                                                             seed=1000 * (mode == "b") + c,
                                                             turns=args.turns, vocab=vocab))
                print(f"conversation {c + 1}/{args.conversations} done", flush=True)
            results["greedy_mismatches"] = colocated_answers(client, colo.url, runs)
    finally:
        for dep in {id(d): d for d in deps.values()}.values():
            dep.stop()
        if colo is not None:
            colo.stop()
        remove_worktrees(tmp)
    results.update(summarize(runs, model, BLOCK_SIZE))
    for records in (r for modes in runs.values() for convs in modes.values() for r in convs):
        for r in records:
            del r["prompt"], r["answer"]  # lengths are kept, and whether the answer matched
    results["runs"] = runs
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
