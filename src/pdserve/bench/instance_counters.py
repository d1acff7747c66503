"""What the instances themselves counted during a run: each instance's `/metrics` scraped before and
after, the difference summed over instances.

Benchmark client process. Any server may be named: an instance that does not export a counter (a
vLLM server, an older pdserve) leaves it out, and one that cannot be reached is reported as such,
never fatal. A counter lower after than before (the instance restarted) counts from zero, as does
one that appears during the run (a labelled histogram has no samples before its first observation).
"""

from __future__ import annotations

import sys

import httpx

COUNTERS = {
    "prefix_cache_queries": "pdserve:prefix_cache_queries_total",  # prompt tokens looked up
    "prefix_cache_hits": "pdserve:prefix_cache_hits_total",  # ... and found
    "prompt_tokens_computed": "pdserve:prompt_tokens_computed_total",
    "kv_blocks_read": "pdserve:kv_blocks_read_total",  # decode READ from a producer
    "kv_blocks_read_skipped": "pdserve:kv_blocks_read_skipped_total",  # ... not, as decode cached them
    "kv_blocks_pulled": "pdserve:kv_blocks_pulled_total",  # a producer READ from decode's cache
    "kv_bytes_transferred": "pdserve:nixl_bytes_transferred_sum",  # every READ's bytes
}

Counts = dict[str, float]


def instance_urls(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """A pdserve proxy's instances (its /health lists them by role), else the URL itself."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        health = httpx.get(base_url + "/health", headers=headers, timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return [base_url]
    if isinstance(health, dict) and isinstance(health.get("decode"), dict):
        roles = (health.get("prefill") or {}, health["decode"])
        return [url for role in roles if isinstance(role, dict) for url in role]
    return [base_url]


def parse(text: str) -> Counts:
    """Each metric's samples summed over label sets."""
    sums: Counts = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (ValueError, IndexError):
                continue
    return {key: sums[name] for key, name in COUNTERS.items() if name in sums}


def scrape(urls: list[str], api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, Counts | None]:
    """url -> its counters (None: it did not answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, Counts | None] = {}
    for url in urls:
        try:
            r = httpx.get(url + "/metrics", headers=headers, timeout=timeout_s)
            r.raise_for_status()
            out[url] = parse(r.text)
        except httpx.HTTPError as e:
            print(f"warning: {url}/metrics: {type(e).__name__}: {e}", file=sys.stderr)
            out[url] = None
    return out


def delta(before: dict[str, Counts | None], after: dict[str, Counts | None]) -> dict[str, Counts | None]:
    out: dict[str, Counts | None] = {}
    for url, b in before.items():
        a = after.get(url)
        out[url] = None if a is None or b is None else {
            k: a[k] - b.get(k, 0.0) if a[k] >= b.get(k, 0.0) else a[k] for k in a}
    return out


def summarize(deltas: dict[str, Counts | None], prompt_tokens_sent: int) -> dict:
    """Totals over the instances, `prefix_cache_hit_rate` (hits / queries, vLLM's; in P/D the
    producer and decode each look a prompt up) and `prefill_hit_rate` (1 - prompt tokens computed
    anywhere / prompt tokens sent: the share no instance computed, as the LRU bound counts)."""
    out: dict = {"instances": deltas}
    for key in COUNTERS:
        values = [d[key] for d in deltas.values() if d and key in d]
        if values:
            out[key] = sum(values)
    if out.get("prefix_cache_queries"):
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / out["prefix_cache_queries"]
    if "prompt_tokens_computed" in out and prompt_tokens_sent:
        out["prefill_hit_rate"] = 1 - out["prompt_tokens_computed"] / prompt_tokens_sent
    return out
