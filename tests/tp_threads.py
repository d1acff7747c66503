"""A model's logits at TP 1 or 2 with the ranks as threads of the test process (gloo over a local
TCP store): TP sharding tests without spawning rank processes."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from pdserve.model.loader import load_model
from pdserve.model.parallel import make_group
from pdserve.model.spec import ModelSpec
from pdserve.worker.kv_cache import CacheLayout, KVCache
from pdserve.worker.messages import ScheduledChunk
from pdserve.worker.model_runner import ModelRunner


def last_logits(model_dir: str, tp_size: int, quantization: str | None, prompt: list[int]) -> torch.Tensor:
    """Rank 0's logits for the prompt's last token, the TP ranks as threads of this process."""
    spec = ModelSpec.from_dir(model_dir)
    store = dist.TCPStore("127.0.0.1", 0, tp_size, is_master=True, wait_for_workers=False) \
        if tp_size > 1 else None
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            client = store if r == 0 else dist.TCPStore("127.0.0.1", store.port, tp_size, is_master=False)
            group = make_group(r, tp_size, "127.0.0.1", 0, 30.0, client)
            model = load_model(model_dir, spec, group, torch.float32, quantization)
            layout = CacheLayout(spec.num_layers, 8, model.layers[0].num_kv_heads, 16, spec.head_dim, 4)
            runner = ModelRunner(model, KVCache(layout, torch.float32))
            out[r] = runner.execute([ScheduledChunk("r", prompt, 0, list(range(8)), True)])[0]
        except Exception as e:  # surfaced below
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(not t.is_alive() for t in threads), "a TP rank hung"
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0][0]
