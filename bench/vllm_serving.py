"""pdserve's P/D beside vLLM's P/D on the same two cores and workload, and each colocated: the
serving sweep's mixed workload at a few rates, goodput side by side.

    # once: the vLLM venv of bench/vllm_compare.py, plus NIXL for vLLM's NixlConnector
    /tmp/vllm-venv/bin/pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    .venv/bin/python bench/vllm_serving.py --vllm-python /tmp/vllm-venv/bin/python

vLLM's P/D: two `vllm.entrypoints.openai.api_server` with NixlConnector and `kv_buffer_device:
cpu`, prefill on core 0 and decode on core 1, behind `pdserve proxy --upstream-protocol vllm`.
vLLM colocated: one server on both cores. pdserve: `pdserve up` 1P1D on the same cores, plain and
conditional (short prompts prefilled on decode), and one `pdserve serve` with 2 threads. vLLM's CPU
workers spin while idle, so each arrangement runs alone.
vLLM cannot report a port it bound itself: it takes the fixed `--vllm-port` (HTTP, +1 for the
decode instance) and `--vllm-side-channel-port` (NIXL side channel, +1 likewise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Instance, _die_with_parent, _health, stop_group  # noqa: E402

KV_CONFIG = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'


class Vllm:
    """One vLLM OpenAI server in its own process group (its engine and worker die with it)."""

    def __init__(self, python: str, model: str, port: int, cores: str, logs: Path, side_channel_port: int | None):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores,
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
                "--no-enable-prefix-caching"]
        if side_channel_port is not None:
            env.update(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port))
            args += ["--kv-transfer-config", KV_CONFIG]
        self.url = f"http://127.0.0.1:{port}"
        self.log = logs / f"vllm-{port}.log"
        self.proc = subprocess.Popen(args, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)

    def wait_healthy(self, timeout_s: float = 600) -> "Vllm":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log: {self.log}")
            if _health(self.url + "/health")[0] == 200:
                return self
            time.sleep(1)
        raise TimeoutError(f"vLLM not healthy within {timeout_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        stop_group(self.proc, 30)


def sweep(targets: list[str], out: Path, workload: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "sweep", *workload, "--result-dir", str(out)]
    for t in targets:
        cmd += ["--target", t]
    subprocess.run(cmd, check=True, timeout=3600)
    return json.loads((out / "sweep.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--request-rates", default="1,2,4")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--vllm-port", type=int, default=8301)
    ap.add_argument("--vllm-side-channel-port", type=int, default=5701)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm_serving.json"))
    args = ap.parse_args()
    model = ensure_model(args.model)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-vllm-serving-"))
    workload = ["--request-rates", args.request_rates, "--dataset-name", "mixed", "--num-prompts",
                str(args.num_prompts), "--random-input-len", "128", "--mixed-long-len", "1536",
                "--random-output-len", "128", "--goodput", "ttft:2000", "itl:150"]
    results: dict[str, dict] = {}

    servers = [Vllm(args.vllm_python, model, args.vllm_port, "0", logs, args.vllm_side_channel_port),
               Vllm(args.vllm_python, model, args.vllm_port + 1, "1", logs, args.vllm_side_channel_port + 1)]
    proxy = Instance("proxy", ["proxy", "--port", "0", "--upstream-protocol", "vllm",
                               "--prefill", servers[0].url, "--decode", servers[1].url])
    try:
        for s in servers:
            s.wait_healthy()
        proxy.spawn(logs).wait_healthy(60)
        results.update(_runs(sweep([f"vllm-pd={proxy.url}"], logs / "vllm-pd", workload)))
    finally:
        proxy.stop()
        for s in servers:
            s.stop()

    colocated = Vllm(args.vllm_python, model, args.vllm_port, "0-1", logs, None)
    try:
        colocated.wait_healthy()
        results.update(_runs(sweep([f"vllm-colocated-1x2={colocated.url}"], logs / "vllm-colocated", workload)))
    finally:
        colocated.stop()

    results.update(_runs(sweep([f"pd=up {model} --prefill-cpus 0 --decode-cpus 1",
                                f"pd-conditional=up {model} --prefill-cpus 0 --decode-cpus 1 --proxy-args "
                                "'--local-prefill-max-tokens 256' --decode-args '--max-num-batched-tokens 64'",
                                f"colocated-1x2=serve {model} --cpus 0-1 --num-threads 2"],
                               logs / "pdserve", workload)))
    rates = sorted({rate for runs in results.values() for rate in runs})
    summary = {"model": Path(model).name, "workload": workload, "targets": results, "rates": rates,
               "pd_vs_vllm_pd_goodput": {str(r): _ratio(_best(results, ("pd", "pd-conditional"), r),
                                                        results["vllm-pd"].get(r)) for r in rates}}
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["pd_vs_vllm_pd_goodput"]))
    return 0


def _runs(summary: dict) -> dict[str, dict[float, dict]]:
    """target -> rate -> the few numbers the README shows."""
    out: dict[str, dict[float, dict]] = {}
    for r in summary["runs"]:
        out.setdefault(r["target"], {})[r["request_rate"]] = {
            "goodput": round(r["request_goodput"], 2), "share": r["goodput_fraction"],
            "ttft_p50_ms": round(r["p50_ttft_ms"]), "itl_p99_ms": round(r["p99_itl_ms"]),
            "max_itl_p99_ms": round(r["p99_max_itl_per_request_ms"]), "completed": r["completed"]}
    return out


def _best(results: dict, targets: tuple[str, ...], rate: float) -> dict | None:
    """The run with the highest goodput among `targets` at `rate`."""
    runs = [results[t][rate] for t in targets if rate in results.get(t, {})]
    return max(runs, key=lambda r: r["goodput"], default=None)


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b:
        return None
    return round(a["goodput"] / b["goodput"], 2) if b["goodput"] else None


if __name__ == "__main__":
    sys.exit(main())
