"""Soak: mixed load through a 2-prefill + 1-decode deployment (as `pdserve up` starts it), with
random client cancels and a seeded schedule of producer kills and restarts.

    .venv/bin/python bench/soak.py [--duration 300] [--clients 6] [--seed 0] [--kill-every 40]

Records every request (outcome, latency, whether a kill happened while it was in flight), each
instance's RSS every second, and at the end each instance's free blocks once idle. The verdict:
only requests a kill touched may fail, each with a clear error; no block leaks; RSS flat. Writes
bench/results/soak.json and bench/results/soak.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Deployment, Instance  # noqa: E402

ARGS = ["--num-blocks", "256", "--kv-lease-s", "5", "--kv-transfer-timeout-s", "3",
        "--kv-handshake-timeout-s", "3", "--max-num-seqs", "16", "--enable-debug-endpoints"]


def rss_mib(inst: Instance) -> float:
    """Resident memory of the instance's process group (its TP ranks included)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == inst.proc.pid:  # process group id
                status = (stat.parent / "status").read_text()
                total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    return total / 1024


class Soak:
    def __init__(self, dep: Deployment, args):
        self.dep = dep
        self.args = args
        self.rng = random.Random(args.seed)
        self.records: list[dict] = []
        self.kills: list[tuple[float, float]] = []  # (killed at, back at)
        self.rss: list[dict] = []
        self.t0 = time.monotonic()
        self.stop_at = self.t0 + args.duration

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def client(self, cid: int) -> None:
        rng = random.Random(self.args.seed * 1000 + cid)
        async with httpx.AsyncClient(base_url=self.dep.proxy.url, timeout=120) as h:
            while time.monotonic() < self.stop_at:
                n = rng.choice([16, 64, 200, 500, 1000])
                prompt = [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]
                body = {"prompt": prompt, "max_tokens": rng.choice([8, 32, 128]), "temperature": 0,
                        "ignore_eos": True, "stream": True}
                cancel_after = rng.uniform(0.05, 1.0) if rng.random() < 0.15 else None
                await self.one(h, body, cancel_after)

    async def one(self, h: httpx.AsyncClient, body: dict, cancel_after: float | None) -> None:
        rec = {"start": self.now(), "prompt": len(body["prompt"]), "outcome": "ok", "error": None}
        try:
            await asyncio.wait_for(self._stream(h, body, rec), cancel_after or 120)
        except asyncio.TimeoutError:
            rec["outcome"] = "cancelled" if cancel_after else "timeout"
        except httpx.HTTPError as e:
            rec["outcome"], rec["error"] = "error", f"{type(e).__name__}: {e}"
        rec["end"] = self.now()
        self.records.append(rec)

    async def _stream(self, h, body, rec) -> None:
        async with h.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["outcome"] = "error"
                rec["error"] = f"{r.status_code}: {(await r.aread())[:200].decode(errors='replace')}"
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line:
                    rec["outcome"], rec["error"] = "error", line[6:200]
                elif line.startswith("data: {") and "ttft" not in rec:
                    rec["ttft"] = self.now() - rec["start"]

    async def chaos(self) -> None:
        """Every ~kill_every seconds, SIGKILL a random producer; bring it back at the same port."""
        while True:
            await asyncio.sleep(self.rng.uniform(0.5, 1.5) * self.args.kill_every)
            if time.monotonic() > self.stop_at - 10:
                return
            victim = self.rng.choice(self.dep.prefill)
            killed = self.now()
            victim.kill()
            await asyncio.sleep(self.rng.uniform(1, 5))
            victim.args += ["--port", str(victim.port)]
            victim.spawn(self.dep.log_dir, self.dep.env)
            await asyncio.to_thread(victim.wait_healthy, 120)
            self.kills.append((killed, self.now()))

    async def sample_rss(self) -> None:
        while time.monotonic() < self.stop_at:
            self.rss.append({"t": self.now(), **{f"{i.role}{k}": rss_mib(i) for k, i in enumerate(self.dep.instances)}})
            await asyncio.sleep(1.0)

    async def run(self) -> None:
        chaos = asyncio.ensure_future(self.chaos())
        await asyncio.gather(self.sample_rss(), *(self.client(c) for c in range(self.args.clients)))
        chaos.cancel()
        await asyncio.gather(chaos, return_exceptions=True)

    def touched(self, rec: dict) -> bool:
        """In flight when a producer was killed (later requests must find the other one)."""
        return any(rec["start"] <= killed + 0.5 and rec["end"] >= killed for killed, _ in self.kills)


def idle_blocks(inst: Instance, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        s = httpx.get(inst.url + "/debug/stats", timeout=10).json()
        idle = s["num_free_blocks"] == s["num_blocks"] and not s["num_running"] and not s["num_waiting"]
        if idle or time.monotonic() > deadline:
            return {"free": s["num_free_blocks"], "total": s["num_blocks"]}
        time.sleep(0.2)


def summarize(soak: Soak, dep: Deployment) -> dict:
    recs = soak.records
    ok = [r for r in recs if r["outcome"] == "ok"]
    failed = [r for r in recs if r["outcome"] in ("error", "timeout")]
    untouched_failures = [r for r in failed if not soak.touched(r)]
    e2e = sorted(r["end"] - r["start"] for r in ok)
    ttft = sorted(r["ttft"] for r in ok if "ttft" in r)

    def pct(xs, q):
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None
    blocks = {f"{i.role}{k}": idle_blocks(i) for k, i in enumerate(dep.instances)}
    rss_growth = {}
    if len(soak.rss) > 4:
        for key in soak.rss[0]:
            if key != "t":
                first = statistics.median(s[key] for s in soak.rss[:3])
                last = statistics.median(s[key] for s in soak.rss[-3:])
                rss_growth[key] = round(last - first, 1)
    return {
        "duration_s": soak.args.duration, "clients": soak.args.clients, "seed": soak.args.seed,
        "requests": len(recs), "ok": len(ok), "cancelled": sum(r["outcome"] == "cancelled" for r in recs),
        "failed": len(failed), "failed_touched_by_a_kill": len(failed) - len(untouched_failures),
        "failed_untouched": len(untouched_failures),
        "untouched_failure_examples": [r["error"] for r in untouched_failures[:5]],
        "failure_examples": [r["error"] for r in failed[:5]],
        "kills": len(soak.kills), "e2e_p50_s": pct(e2e, 0.5), "e2e_p99_s": pct(e2e, 0.99),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
        "leaked_blocks": {k: v["total"] - v["free"] for k, v in blocks.items()},
        "rss_growth_mib": rss_growth, "rss": soak.rss, "kill_times": soak.kills,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    rss = result["rss"]
    for key in rss[0]:
        if key != "t":
            ax.plot([s["t"] for s in rss], [s[key] for s in rss], label=key)
    for killed, back in result["kill_times"]:
        ax.axvspan(killed, back, color="red", alpha=0.15)
    ax.set_xlabel("seconds (red: a producer killed until it is back)")
    ax.set_ylabel("RSS MiB")
    ax.set_title(f"soak: {result['requests']} requests, {result['kills']} kills, "
                 f"{result['failed_untouched']} failures no kill explains")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--duration", type=float, default=300)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-every", type=float, default=40)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    ap.add_argument("--plot", default=str(Path(__file__).parent / "results" / "soak.png"))
    args = ap.parse_args(argv)
    model = ensure_model(args.model, "tiny")
    dep = Deployment(model, [1, 1], [1], instance_args=ARGS, log_dir=tempfile.mkdtemp(prefix="pdserve-soak-"))
    dep.start(timeout_s=180)
    try:
        soak = Soak(dep, args)
        asyncio.run(soak.run())
        result = summarize(soak, dep)
    finally:
        dep.stop()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    print(json.dumps({k: v for k, v in result.items() if k not in ("rss", "kill_times")}, indent=1))
    return result


if __name__ == "__main__":
    main()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
