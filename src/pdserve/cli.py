"""`pdserve` command line: make-model, generate, serve, proxy, up, ray, bench.

Reads the environment (PDSERVE_HOME, PDSERVE_API_KEY, PDSERVE_KV_SECRET, PDSERVE_KV_SECRET_PREVIOUS,
PDSERVE_ADMIN_KEY); launchers pass PDSERVE_KV_SECRET on to the instances they start.
Each subcommand builds frozen configs and hands them to its entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from pdserve.cpus import parse_cpus
from pdserve.config import (CacheConfig, ConfigError, EngineConfig, KVEventsConfig, KVTransferConfig,
                            ParallelConfig, ProxyConfig, SchedulerConfig, ServerConfig)


def pdserve_home() -> Path:
    return Path(os.environ.get("PDSERVE_HOME", Path.home() / ".cache" / "pdserve"))


def default_model_dir(preset: str = "small") -> Path:
    return pdserve_home() / "models" / preset


def ensure_model(model: str | None, preset: str = "small") -> str:
    """The checkpoint directory to serve: the given one, a GGUF file's converted copy (made once),
    or the default generated model (created when missing)."""
    if model:
        from pdserve.checkpoints.gguf_file import checkpoint_dir
        return checkpoint_dir(model, pdserve_home() / "gguf")
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
              dtype=args.dtype, quantization=args.quantization, num_threads=args.num_threads)
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                seed=args.seed)
        for out in llm.generate(args.prompt, params):
            print(f"{out.prompt!r} -> {out.outputs[0].text!r}")
    finally:
        llm.shutdown()
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    add_quantization_arg(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--mock-engine", action="store_true",
                   help="serve without computing: no weights are loaded, each step sleeps as long as the real "
                        "engine's would on this machine, tokens are a fixed function of the context (routing "
                        "at scale: many instances on two cores); everything else is real, KV transfers included")
    p.add_argument("--mock-speedup", type=float, default=1.0, help="--mock-engine's steps this many times faster")
    p.add_argument("--num-blocks", type=int, default=None, help="fixed KV block count per rank")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV budget per rank")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3",
                                                                 "fp8"],
                   help="the KV cache's stored dtype (auto: the model's); fp8_e4m3 keeps a float32 scale per "
                        "token and head; P/D peers convert between float dtypes and refuse other pairs")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-stall-s", type=float, default=0.0,
                   help="while streams run here, a step prefills at most what this instance prefills in "
                        "this long (its measured rate), so a long prompt holds their next token about this "
                        "much per step; pdserve up gives decode instances 0.1 (0: the token budget alone)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per rank (default: this process's cores / TP size)")
    p.add_argument("--cpus", default=None, help="cores for this instance, e.g. 0-3 or 0,2")
    p.add_argument("--no-kv-transfer", action="store_true", help="start without the P/D connector")
    p.add_argument("--side-channel-host", default="127.0.0.1")
    p.add_argument("--side-channel-port", type=int, default=0)
    p.add_argument("--advertised-host", default=None,
                   help="host decode instances dial for this producer (multi-host)")
    p.add_argument("--kv-lease-s", type=float, default=30.0)
    p.add_argument("--kv-handshake-timeout-s", type=float, default=10.0)
    p.add_argument("--kv-transfer-timeout-s", type=float, default=30.0)
    p.add_argument("--kv-load-failure-policy", default="fail", choices=["fail", "recompute"])
    p.add_argument("--kv-pull-min-tokens", type=int, default=64,
                   help="a producer whose proxy names instances caching a later turn's prompt (decode "
                        "instances that served the earlier turns) READs that many uncached prompt tokens "
                        "or more from them instead of computing them (0: never)")
    p.add_argument("--kv-clock-skew-s", type=float, default=5.0,
                   help="signed params are still accepted this long after their expiry (the producer's "
                        "and this host's clocks may differ; at most 300)")
    p.add_argument("--kv-producers", default=None, metavar="HOST:PORT,...",
                   help="side channels this instance may dial as a consumer (default: any whose params "
                        "are signed)")
    p.add_argument("--allow-insecure-side-channel", action="store_true",
                   help="run a side channel reachable off loopback without PDSERVE_KV_SECRET (warned)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='vLLM\'s KV events, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}\' (binds on '
                        '"*" or port 0; /health shows the bound endpoints); "encoding": "array" for vLLM\'s '
                        'older positional messages')
    p.add_argument("--kv-copy-lanes", type=int, default=1,
                   help="copy threads per decode rank for READs of 1 MiB or more (on host memory each "
                        "copies at one core's speed; more than the rank's cores does not help)")


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", "-q", default=None, choices=["none", "int8", "int4"],
                   help="weights kept quantized: int8 per output channel, int4 in groups of 32 (embedding "
                        "and LM head int8); none dequantizes. Default: the checkpoint's own (a GGUF file's "
                        "Q8_0 as int8, Q4_0/Q4_1/Q4_K as int4, others dequantized; else none)")


def engine_config(args) -> EngineConfig:
    kv = None
    if not args.no_kv_transfer:
        secret = os.environ.get("PDSERVE_KV_SECRET")
        previous = os.environ.get("PDSERVE_KV_SECRET_PREVIOUS")  # accepted, never signed with (rotation)
        kv = KVTransferConfig(
            side_channel_host=args.side_channel_host, side_channel_port=args.side_channel_port,
            advertised_host=args.advertised_host, lease_s=args.kv_lease_s,
            handshake_timeout_s=args.kv_handshake_timeout_s,
            transfer_timeout_s=args.kv_transfer_timeout_s,
            failure_policy=args.kv_load_failure_policy, copy_lanes=args.kv_copy_lanes,
            secret=secret.encode() if secret else None,
            previous_secret=previous.encode() if previous else None, clock_skew_s=args.kv_clock_skew_s,
            producers=tuple(p for p in (args.kv_producers or "").split(",") if p),
            allow_insecure=args.allow_insecure_side_channel)
    cpus = parse_cpus(args.cpus)
    tp = args.tensor_parallel_size
    rank_cpus = ()
    if cpus and len(cpus) >= tp:  # one slice of the instance's cores per rank
        per = len(cpus) // tp
        rank_cpus = tuple(tuple(cpus[r * per:(r + 1) * per]) for r in range(tp))
    return EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
        chat_template=args.chat_template, mock_engine=args.mock_engine, mock_speedup=args.mock_speedup,
        num_threads=args.num_threads,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_gib=args.kv_cache_gib, kv_cache_dtype=args.kv_cache_dtype,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  kv_pull_min_tokens=args.kv_pull_min_tokens,
                                  max_prefill_stall_s=args.max_prefill_stall_s),
        parallel=ParallelConfig(tensor_parallel_size=tp, rank_cpus=rank_cpus),
        kv_transfer=kv,
        kv_events=KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else KVEventsConfig())


def _serve(args) -> int:
    cpus = parse_cpus(args.cpus)
    if cpus:  # before torch starts any thread: every thread of this instance inherits it
        os.sched_setaffinity(0, cpus)
    from pdserve.server.runner import run_server
    name = args.served_model_name or _model_name(args.model)
    args.model = ensure_model(args.model)
    server = ServerConfig(
        host=args.host, port=args.port, served_model_name=name,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"), max_pending=args.max_pending,
        shutdown_timeout_s=args.shutdown_timeout_s, drain_timeout_s=args.drain_timeout_s,
        port_file=args.port_file,
        enable_debug_endpoints=args.enable_debug_endpoints, generation_config=args.generation_config,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser)
    run_server(server, engine_config(args), args.log_level.upper())
    return 0


def _proxy(args) -> int:
    from pdserve.proxy.runner import run_proxy
    config = ProxyConfig(
        prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode), host=args.host,
        port=args.port, api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
        upstream_api_key=args.upstream_api_key or os.environ.get("PDSERVE_UPSTREAM_API_KEY"),
        port_file=args.port_file, upstream_protocol=args.upstream_protocol,
        max_request_body_bytes=args.max_request_body_bytes, probe_interval_s=args.probe_interval_s,
        max_wait_s=args.max_wait_s, local_prefill_max_tokens=args.local_prefill_max_tokens,
        request_timeout_s=args.request_timeout_s, routing=args.routing,
        tokenizer=ensure_model(args.tokenizer) if args.tokenizer else None, chat_template=args.chat_template,
        local_prefill_max_queue=args.local_prefill_max_queue, admin_key=os.environ.get("PDSERVE_ADMIN_KEY"),
        kv_events_drop_fraction=args.kv_events_drop_fraction, kv_events_drop_seed=args.kv_events_drop_seed,
        kv_copies=args.kv_copies, placement_log=args.placement_log)
    run_proxy(config, args.log_level.upper())
    return 0


def _up(args) -> int:
    from pdserve.launcher import run_up
    name = _model_name(args.model)
    args.model = ensure_model(args.model)  # a GGUF file is converted once, here
    if args.routing:
        args.proxy_args += f" --routing {args.routing}"
    if args.mock_engine:
        args.instance_args += " --mock-engine"
        if args.mock_speedup:
            args.instance_args += f" --mock-speedup {args.mock_speedup}"
    if name:
        args.instance_args += f" --served-model-name {shlex.quote(name)}"
    if args.ray is not None:
        from pdserve.cluster.driver import run_up as run_up_on_ray
        return run_up_on_ray(args, args.model)
    return run_up(args)


def _ray_scale(args) -> int:
    from pdserve.cluster.driver import run_scale
    return run_scale(args)


def _ray_status(args) -> int:
    from pdserve.cluster.driver import run_status
    return run_status(args)


def _model_name(model: str | None) -> str | None:
    """What clients call a GGUF file's model (its file name without .gguf)."""
    return Path(model).stem if model and model.endswith(".gguf") else None


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
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or .gguf file (default: the generated small model)")
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    add_quantization_arg(p)
    p.add_argument("--num-threads", type=int, default=None)
    p.set_defaults(func=_generate)

    p = sub.add_parser("serve", help="run one OpenAI-compatible instance")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or .gguf file (default: the generated small model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed)")
    p.add_argument("--port-file", default=None, help="write the bound port here as JSON")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None, help="also read from PDSERVE_API_KEY")
    p.add_argument("--max-pending", type=int, default=1024)
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20, help="larger bodies get a 413")
    p.add_argument("--shutdown-timeout-s", type=float, default=10.0,
                   help="on SIGTERM, in-flight HTTP requests get this long to finish")
    p.add_argument("--drain-timeout-s", type=float, default=60.0,
                   help="then leases for remote readers and KV loads get this long to end")
    p.add_argument("--enable-debug-endpoints", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--chat-template", default=None,
                   help="a chat template file (or the template itself) instead of the checkpoint's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='vLLM\'s: tool_choice "auto" reads the model\'s tool calls (needs --tool-call-parser)')
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="the model family's tool-call format (vLLM's names)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render chat templates that requests bring (vLLM's flag; each renders in a child "
                        "process, bounded in time, memory and output); without it they are a 400")
    p.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                   help="auto: sampling defaults from the checkpoint's generation_config.json")
    add_engine_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("proxy", help="route each request P -> D (xPyD, round-robin)")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                   help="producers (none: every request goes to a decode instance whole)")
    p.add_argument("--decode", nargs="*", default=[], metavar="URL",
                   help="decode instances (none: registered later, with PDSERVE_ADMIN_KEY set)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--port-file", default=None)
    p.add_argument("--api-key", default=None, help="clients must send it (also PDSERVE_API_KEY)")
    p.add_argument("--upstream-api-key", default=None,
                   help="sent to the instances (also PDSERVE_UPSTREAM_API_KEY)")
    p.add_argument("--max-request-body-bytes", type=int, default=8 << 20, help="larger bodies get a 413")
    p.add_argument("--local-prefill-max-tokens", type=int, default=0,
                   help="conditional disaggregation: prompts up to this many tokens prefill on decode "
                        "while few wait to be prefilled there (0: every prompt prefills on a producer); "
                        "give decode instances a small --max-num-batched-tokens (e.g. 64) so a local "
                        "prefill adds little to each step of the streams decode is running")
    p.add_argument("--local-prefill-max-queue", type=int, default=2,
                   help="... while at most this many prompts wait to be prefilled on decode")
    p.add_argument("--max-wait-s", type=float, default=30.0,
                   help="how long a request waits while every prefill instance is busy, then 503")
    p.add_argument("--probe-interval-s", type=float, default=1.0,
                   help="how often the instances' health and load are asked")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="how long the proxy waits for an instance's next bytes (a whole answer, or the next "
                        "event of a stream); then the client gets a 502 naming the instance")
    p.add_argument("--routing", default="kv-aware", choices=["round-robin", "least-loaded", "kv-aware"],
                   help="how instances are chosen: kv-aware weighs what each caches of the prompt (from their "
                        "KV events; needs --tokenizer) against its queue, and prefills on decode what decode "
                        "lacks little of")
    p.add_argument("--tokenizer", default=None, metavar="MODEL",
                   help="the served checkpoint (directory or .gguf): prompts are tokenized as the instances "
                        "do, to route by the blocks they fill (pdserve up passes it)")
    p.add_argument("--chat-template", default=None,
                   help="the instances' --chat-template, where they were given one (pdserve up passes it)")
    p.add_argument("--kv-copies", default="one", choices=["one", "both"],
                   help="kv-aware: a prompt prefilled on a producer is cached by it and by its decode instance; "
                        "one (default) keeps one of the two, alternating between the pools by conversation, and "
                        "makes the other a spare copy that instance reuses first, so the instances together "
                        "cache more distinct prompts; both keeps both alike")
    p.add_argument("--placement-log", default=None, metavar="FILE",
                   help="append one JSON line per request the proxy tokenized: its first-choice producer and "
                        "decode instance, the P/D decision, which copy is the spare, and (kv-aware) the prompt "
                        "tokens each instance held by the KV index: routing, replayable offline")
    p.add_argument("--upstream-protocol", default="auto", choices=["auto", "pdserve", "vllm"],
                   help="what the instances are: vllm producers get max_tokens 1 (auto: ask them)")
    # benchmarks of the KV index's repairs (bench/index_exactness.py): lose batches on purpose, seeded
    p.add_argument("--kv-events-drop-fraction", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--kv-events-drop-seed", type=int, default=0, help=argparse.SUPPRESS)
    p.set_defaults(func=_proxy)

    p = sub.add_parser("up", help="start a local P/D deployment: prefill, decode and proxy")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or .gguf file (default: the generated small model)")
    p.add_argument("--prefill", type=int, default=1,
                   help="number of prefill instances (0: the decode instances serve requests whole)")
    p.add_argument("--prefill-tp", type=int, default=1)
    p.add_argument("--decode", type=int, default=1, help="number of decode instances")
    p.add_argument("--decode-tp", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="the proxy's bind address (clients reach it there)")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port (0 = any free port)")
    p.add_argument("--prefill-cpus", default=None,
                   help="cores per prefill instance, ';'-separated (default: the host's split evenly)")
    p.add_argument("--decode-cpus", default=None, help="cores per decode instance, ';'-separated")
    p.add_argument("--ask", default=None, help="send this prompt through the proxy once all is up")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--exit", action="store_true", help="stop everything after answering --ask")
    p.add_argument("--log-dir", default=None, help="instance logs (default: a temporary directory)")
    p.add_argument("--instance-args", default="", help="extra arguments for every `pdserve serve`")
    p.add_argument("--prefill-args", default="", help="extra arguments for prefill instances only (after "
                   "--instance-args)")
    p.add_argument("--decode-args", default="", help="extra arguments for decode instances only, e.g. "
                   "\"--max-num-batched-tokens 64\" to bound what a local prefill adds to a step (they get "
                   "--max-prefill-stall-s 0.1 first)")
    p.add_argument("--port-file", default=None, help="write the proxy's bound port here as JSON")
    p.add_argument("--proxy-args", default="", help="extra arguments for `pdserve proxy`")
    p.add_argument("--routing", default=None, choices=["round-robin", "least-loaded", "kv-aware"],
                   help="the proxy's routing (default kv-aware: `pdserve proxy --help`)")
    p.add_argument("--mock-engine", action="store_true",
                   help="every instance serves with `pdserve serve --mock-engine` (no weights; steps sleep as long "
                        "as real ones): many instances on two cores")
    p.add_argument("--mock-speedup", type=float, default=None, help="passed to every instance with --mock-engine")
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="place the instances on a Ray cluster (ADDRESS: its head, default RAY_ADDRESS or "
                        "the local one); the model path must exist on every node")
    p.add_argument("--prefill-resources", default=None, metavar="JSON",
                   help='with --ray: custom resources each prefill instance needs, e.g. \'{"node_a": 1}\'')
    p.add_argument("--decode-resources", default=None, metavar="JSON", help="with --ray: the same for decode")
    p.add_argument("--ray-threads-per-rank", type=int, default=1,
                   help="with --ray: torch threads per TP rank (each instance asks Ray for TP x this CPUs)")
    p.set_defaults(func=_up)

    ray = sub.add_parser("ray", help="a deployment started with `pdserve up --ray`").add_subparsers(
        dest="ray_command", required=True)
    p = ray.add_parser("scale", help="set how many prefill and decode instances run; wait until they serve")
    p.add_argument("--prefill", type=int, default=None)
    p.add_argument("--decode", type=int, default=None)
    p.add_argument("--address", default=None, help="the Ray cluster (default RAY_ADDRESS or the local one)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.set_defaults(func=_ray_scale)
    p = ray.add_parser("status", help="the instances, where they run, whether they serve")
    p.add_argument("--address", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_ray_status)

    bench = sub.add_parser("bench", help="serving benchmarks").add_subparsers(dest="bench", required=True)
    from pdserve.bench import serve as bench_serve
    from pdserve.bench import sweep as bench_sweep
    p = bench.add_parser("serve", help="load any OpenAI-compatible server (vllm bench serve's flags)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    bench_serve.add_arguments(p)
    p.set_defaults(func=bench_serve.main)
    p = bench.add_parser("sweep", help="one workload, several rates, several deployments; plots")
    bench_sweep.add_arguments(p)
    p.set_defaults(func=bench_sweep.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args) or 0
    except ConfigError as e:
        parser.exit(2, f"pdserve: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
