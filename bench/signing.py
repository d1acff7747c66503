"""What signing costs a request: the producer signs its params once, the consumer verifies once and
shows the params' digest in its heartbeats; a DONE notification is signed and checked once per
(consumer rank, producer rank).

    .venv/bin/python bench/signing.py [--iterations 20000]

Median of 5 runs of N operations each, on params of a 2,048-token prompt (128 blocks). Target: the
whole signing work of one request under 0.1 ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.kv_transfer.messages import Notification, NotificationKind  # noqa: E402
from pdserve.kv_transfer.params import FirstToken, KVTransferParams, prompt_hash  # noqa: E402
from pdserve.kv_transfer.signing import (notification_mac_ok, sign, sign_notification,  # noqa: E402
                                         verify)

SECRET = b"0123456789abcdef" * 4


def per_op_us(fn, iterations: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        runs.append((time.perf_counter() - start) / iterations * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "signing.json"))
    args = ap.parse_args()
    params = KVTransferParams(
        do_remote_prefill=True, remote_engine_id="host-1234-abcdef12", remote_host="10.0.0.1",
        remote_port=5600, remote_block_ids=tuple(range(1000, 1128)), remote_request_id="cmpl-abc-0-x",
        producer_tp_size=2, first_token=FirstToken(42, -0.25), prompt_hash=prompt_hash(list(range(2048))),
        lease_s=30.0, expires_at=time.time() + 30)
    signed = KVTransferParams(**{**params.__dict__, "signature": sign(params, SECRET)})
    note = Notification("cmpl-abc-0-x", "host-5678-12345678", 0, 2, NotificationKind.DONE)
    signed_note = sign_notification(note, SECRET)
    ops = {
        "sign params (producer)": lambda: sign(params, SECRET),
        "verify params (consumer)": lambda: verify(signed, SECRET, time.time()),
        "lease digest (per heartbeat)": signed.lease_digest,
        "sign notification (consumer rank)": lambda: sign_notification(note, SECRET),
        "check notification (producer)": lambda: notification_mac_ok(signed_note, SECRET),
    }
    results = {name: per_op_us(fn, args.iterations) for name, fn in ops.items()}
    per_request = sum(results.values())  # one of each (a heartbeat digest per lease/3 besides)
    for name, us in results.items():
        print(f"{name:36s} {us:7.2f} us")
    print(f"{'one request, all of the above':36s} {per_request:7.2f} us (target < 100 us)")
    Path(args.out).write_text(json.dumps({"per_op_us": results, "per_request_us": per_request,
                                          "iterations": args.iterations}, indent=2) + "\n")


if __name__ == "__main__":
    main()
