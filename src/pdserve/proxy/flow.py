"""One client request through the proxy: prefill on a producer, then decode with its params.

Proxy process (event loop). vLLM's two-call protocol (docs/design.md, "Wire"): the producer gets
the client's body with `stream: false` and `kv_transfer_params: {do_remote_decode: true}` and
answers with its first token and transfer params; the decode instance gets the client's body with
those params, and its answer goes to the client. When the producer's first token ends the request
(EOS or a stop) it returns no params and the proxy answers from the producer alone.

Upstream protocols: `pdserve` instances hand off after their first token whatever `max_tokens`
says, so the client's body goes to them unchanged, and a client that wants one token is simply
served by a producer without a transfer. `vllm` instances generate up to `max_tokens`, so they get
`max_tokens: 1`, as vLLM's own proxy sends. `auto` asks an instance that is up who it is (one
question at a time, not again for `ASK_AGAIN_S` after no answer; pdserve until one answers).

Scoring and fan-out (docs/design.md, "Scoring and fan-out"): a list of prompts is one flow per
prompt, answers merged (fanout.py); `n > 1` prefills once (the producer gets `n: 1`) and decode
forks the samples from the KV it READs once; `max_tokens: 0` is the producer's alone; the prompt's
logprobs come from the producer's answer.

Failures (docs/design.md, "Failures"): how each leg tries the instances is legs.py's. A decode leg
that found no taker hands the producer's lease back at once (`/kv/release`), as does a client that
leaves between the legs. A client that leaves cancels whichever leg runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.http.errors import APIError
from pdserve.proxy.copies import DECODE, PREFILL
from pdserve.proxy.decision import LOCAL, REMOTE, DisaggPolicy, prompt_tokens
from pdserve.proxy.fanout import PromptScores, discard, merge, num_samples, respond, split_prompts, wants_scores
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.placement import Placement, place
from pdserve.proxy.prompts import PromptTokens
from pdserve.proxy.legs import Legs, NoTaker, passed_on
from pdserve.proxy.relay import as_stream, parse_body
from pdserve.proxy.router import Router

logger = logging.getLogger("pdserve.proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
PROTOCOLS = ("auto", "pdserve", "vllm")
CLIENT_GONE = 499  # nginx's code: the client closed the connection
MAX_HOLDERS = 4  # instances named to a producer to claim a prompt's cached blocks from
ASK_AGAIN_S = 5.0  # `auto`: after no answer about the protocol, requests go on as pdserve this long


class PDFlow:
    def __init__(self, router: Router, metrics: ProxyMetrics, protocol: str = "auto", max_wait_s: float = 30.0,
                 policy: DisaggPolicy = DisaggPolicy(), prompts: PromptTokens | None = None,
                 record: Callable[[dict], None] | None = None):
        assert protocol in PROTOCOLS
        self.record = record  # `--placement-log`: told where each tokenized request was placed
        self.router = router
        self.prompts = prompts  # the model's tokenizer: routes by the blocks a prompt fills
        self.metrics = metrics
        self.protocol = None if protocol == "auto" else protocol
        self.policy = policy
        self._asking: asyncio.Future | None = None  # `auto`: the question in flight
        self._ask_after = 0.0
        self.legs = Legs(metrics, max_wait_s)
        self._mismatch_said = False

    async def upstream_protocol(self) -> str:
        """`auto`: the `owned_by` of an instance that is up says (pdserve until one answers)."""
        if self.protocol is None:
            if self._asking is None and time.monotonic() >= self._ask_after:
                self._asking = asyncio.ensure_future(self._ask_protocol())
            if self._asking is not None:
                await asyncio.shield(self._asking)
        return self.protocol or "pdserve"

    async def _ask_protocol(self) -> None:
        try:
            up = [s for s in self.router.prefill.states + self.router.decode.states if s.healthy]
            owner = await up[0].upstream.owner() if up else None
            if owner is not None:
                self.protocol = "vllm" if owner == "vllm" else "pdserve"
                logger.info("upstream protocol: %s (%s is owned by %r)", self.protocol, up[0].url, owner)
            else:
                self._ask_after = time.monotonic() + ASK_AGAIN_S
        finally:
            self._asking = None

    async def handle(self, raw_body: bytes, path: str, request_id: str, is_disconnected) -> Response:
        """The client's answer; the legs are cancelled if the client leaves before it starts."""
        flow = asyncio.ensure_future(self._handle(raw_body, path, request_id))
        watcher = asyncio.ensure_future(_cancel_when_gone(is_disconnected, flow))
        try:
            return await flow
        except asyncio.CancelledError:
            if watcher.done() and not watcher.cancelled():
                return Response(status_code=CLIENT_GONE)
            raise
        except NoTaker as e:
            return e.error().response({"Retry-After": "1"} if e.refused else None)
        except APIError as e:
            return e.response()
        finally:
            watcher.cancel()

    async def _handle(self, raw_body: bytes, path: str, request_id: str) -> Response:
        body = parse_body(raw_body)
        body.pop("kv_transfer_params", None)  # the producer's word, never the client's
        if body.get("stream") and body.get("prompt_logprobs"):  # the instances' rule (vLLM's), before any KV is held
            raise APIError(400, "`prompt_logprobs` are not available when `stream=True`", param="prompt_logprobs")
        parts = split_prompts(body, path)
        if parts is None:
            return await self._handle_one(body, path, request_id)
        answers = await asyncio.gather(*(self._handle_one(b, path, request_id) for b in parts),
                                       return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        if errors:
            discard([a for a in answers if isinstance(a, Response)])
            raise errors[0]
        return await merge(answers, num_samples(body), body, {"X-Request-Id": request_id})

    async def _handle_one(self, body: dict, path: str, request_id: str) -> Response:
        start = time.monotonic()
        headers = {"X-Request-Id": request_id}
        protocol = await self.upstream_protocol()
        ids = self.prompts.ids(body, path) if self.prompts is not None else None
        plan = place(self.router, ids, body.get("cache_salt"))
        if plan.cached_anywhere is not None:
            self.metrics.prompt_tokens.inc(plan.num_tokens)
            self.metrics.prompt_tokens_cached.inc(plan.cached_anywhere)
        n = num_samples(body)
        if _max_tokens(body) == 0 or (protocol == "pdserve" and _max_tokens(body) == 1):  # nothing to decode
            self.metrics.requests.labels("prefill_only").inc()
            if self.router.prefill.states:
                return await self.legs.answer(self.router.prefill, path, body, headers, start, rank=plan.prefill)
            return await self.legs.answer(self.router.decode, path, body, headers, start, rank=plan.decode)
        decision = LOCAL if not self.router.prefill.states or (n > 1 and protocol == "vllm") \
            else self._decide(body, plan)
        self.metrics.decisions.labels(decision).inc()
        headers["X-PD-Decision"] = decision
        spare = self.router.copies.spare(plan.block_hashes, decision == LOCAL) \
            if self.router.copies is not None and protocol == "pdserve" else None
        if self.record is not None and plan.num_tokens is not None:
            self.record({"time": round(time.time(), 4), "request_id": request_id, "prompt_tokens": plan.num_tokens,
                         "decision": decision, "decode": plan.decode[0].url if plan.decode else None,
                         "prefill": plan.prefill[0].url if plan.prefill and decision != LOCAL else None,
                         "spare_copy": spare, "held": plan.held, **plan.predicted})
        holders = _holders(plan, decision, spare, self.router.copies is not None) if protocol == "pdserve" else []
        if decision == LOCAL:  # decode prefills it itself
            self.metrics.requests.labels("decode_only").inc()
            if holders and plan.cached_anywhere is not None:  # kv-aware: it claims what others cache, as a producer
                body = {**body, "kv_transfer_params": {"kv_holders": holders}}
            return await self.legs.answer(self.router.decode, path, body, headers, start, prefills=True,
                                          rank=plan.decode)

        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        p_body["stream"] = False
        p_body["n"] = 1  # one prefill: decode forks the other samples from its KV
        p_body["kv_transfer_params"] = PREFILL_PARAMS
        if holders:
            # instances that may cache this prompt (a history, a shared system prompt): the producer claims it there
            p_body["kv_transfer_params"] = {**PREFILL_PARAMS, "kv_holders": holders}
        if spare == PREFILL:  # decode keeps the prompt's KV; the producer's copy is reused first
            p_body["kv_transfer_params"] = {**p_body["kv_transfer_params"], "spare_copy": True}
        if protocol == "vllm":
            p_body["max_tokens"] = 1
            if "max_completion_tokens" in p_body:
                p_body["max_completion_tokens"] = 1
        producer, p_resp = await self.legs.post(self.router.prefill, path, p_body, headers, rank=plan.prefill)
        self.metrics.prefill.observe(time.monotonic() - start)
        if p_resp.status_code != 200:
            self.metrics.requests.labels(f"prefill_{p_resp.status_code}").inc()
            return passed_on(p_resp, headers)
        p_json = p_resp.json()
        self._check_count(ids, p_json)
        kv = p_json.get("kv_transfer_params")
        if not kv and n > 1:  # the first sample ended at its first token: decode does them all
            self.metrics.requests.labels("decode_only").inc()
            return await self.legs.answer(self.router.decode, path, body, headers, start, prefills=True,
                                          rank=plan.decode)
        if not kv and (protocol == "pdserve" or _all_stopped(p_json)):
            # the first token ended it (EOS, a stop, or the context is full): the producer's answer
            self.metrics.requests.labels("prefill_only").inc()
            if body.get("stream"):
                return StreamingResponse(as_stream(p_json, body), media_type="text/event-stream",
                                         headers=headers)
            return JSONResponse(p_json, headers=headers)
        # (a vLLM producer without a connector returns no params: decode then does it all)
        self.metrics.requests.labels("disaggregated" if kv else "decode_only").inc()
        taken = False
        scores = PromptScores(p_json, body) if kv and wants_scores(body) else None
        d_body = {k: v for k, v in body.items() if k != "prompt_logprobs"} if scores else body
        producer.upstream.hold()  # its client stays open while its lease may have to go back
        if kv and spare == DECODE:  # the producer keeps the prompt's KV; decode's copy is reused first
            kv = {**kv, "spare_copy": True}
        try:
            response = await self.legs.answer(self.router.decode, path, {**d_body, "kv_transfer_params": kv}
                                              if kv else body, headers, start, rank=plan.decode)
            taken = response.status_code == 200
            return respond(response, scores, headers) if scores else response
        finally:
            if kv and not taken:  # no decode instance took it: free the producer's blocks now
                self.legs.release(producer, kv, headers)
            producer.upstream.unhold()

    def _check_count(self, ids: list[int] | None, answer: dict) -> None:
        """The producer's count of the prompt is the truth the proxy's ids should equal: a proxy
        rendering or tokenizing otherwise (another --chat-template, tokenizer or version) routes
        by blocks no instance holds. Counted, and said once."""
        counted = (answer.get("usage") or {}).get("prompt_tokens")
        if ids is None or not isinstance(counted, int) or counted == len(ids):
            return
        self.metrics.prompt_mismatches.inc()
        if not self._mismatch_said:
            self._mismatch_said = True
            logger.warning("the proxy tokenized a prompt to %d tokens, the producer counted %d: routing "
                           "by cached blocks misses while they differ (is the proxy given the instances' "
                           "--chat-template and checkpoint?)", len(ids), counted)

    def _decide(self, body: dict, plan: Placement) -> str:
        """Conditional disaggregation. With kv-aware routing, unless `--local-prefill-max-tokens`
        says otherwise (decision.py, on what the chosen decode instance lacks), decode prefills the
        prompt itself when the placement predicts that fastest (placement.py)."""
        decode_queue = plan.decode[0].prefill_queue() if plan.decode else 1 << 30
        prefill_queue = self.router.prefill.least_queued()
        if plan.decode_uncached is not None:
            if self.policy.local_max_tokens:
                return self.policy.decide(plan.decode_uncached, decode_queue, prefill_queue)
            return LOCAL if plan.local else REMOTE
        tokens = plan.num_tokens if plan.num_tokens is not None else prompt_tokens(body)
        return self.policy.decide(tokens, self.router.decode.least_prefilling(), prefill_queue)


def _holders(plan: Placement, decision: str, spare: str | None, one_copy: bool) -> list[dict]:
    """The instances the prefilling one may claim the prompt's blocks from, as they signed
    themselves. With one copy kept (copies.py), a holder that is not the instance keeping this
    prompt is told that what it lends becomes its spare copy: the history moves rather than being
    kept twice (the index no longer finds it there once it is evicted)."""
    keeper = None
    if one_copy and (decision == LOCAL or spare == PREFILL):
        keeper = plan.decode[0] if plan.decode else None
    elif one_copy and spare == DECODE:
        keeper = plan.prefill[0] if plan.prefill else None
    return [{**s.kv_holder, "spare": True} if keeper is not None and s is not keeper else s.kv_holder
            for s in plan.holders if s.kv_holder][:MAX_HOLDERS]


async def _cancel_when_gone(is_disconnected, task: asyncio.Future, every_s: float = 0.1) -> None:
    while not task.done():
        if await is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(every_s)


def _max_tokens(body: dict):
    value = body.get("max_completion_tokens")
    return body.get("max_tokens") if value is None else value


def _all_stopped(answer: dict) -> bool:
    return all(c.get("finish_reason") == "stop" for c in answer.get("choices") or [{}])

