"""`pdserve` command line: make-model, generate, serve, proxy, up.

The only place that reads the environment (PDSERVE_HOME, PDSERVE_API_KEY, PDSERVE_KV_SECRET).
Each subcommand builds frozen configs and hands them to its entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def default_model_dir(preset: str = "small") -> Path:
    home = Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))
    return home / "models" / preset


def ensure_model(model: str | None, preset: str = "small") -> str:
    """The given model directory, or the default generated model (created when missing)."""
    if model:
        return model
    path = default_model_dir(preset)
    if not (path / "config.json").is_file():
        from pdserve.model.tiny import make_model
        print(f"creating the default {preset} model in {path}", file=sys.stderr)
        make_model(path, preset)
    return str(path)


def _make_model(args) -> int:
    from pdserve.model.tiny import make_model
    out = make_model(args.dir, args.preset, seed=args.seed, num_kv_heads=args.kv_heads,
                     dtype=args.dtype, num_shards=args.shards)
    print(out)
    return 0


def _generate(args) -> int:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams
    llm = LLM(ensure_model(args.model), tensor_parallel_size=args.tensor_parallel_size,
              dtype=args.dtype, num_threads=args.num_threads)
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                seed=args.seed)
        for out in llm.generate(args.prompt, params):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    finally:
        llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-weight checkpoint in Hugging Face layout")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-heads", type=int, default=None, help="override the preset's KV head count")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("generate", help="offline generation with the engine in this process")
    p.add_argument("model", nargs="?", default=None, help="model directory (default: generated small)")
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=_generate)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
