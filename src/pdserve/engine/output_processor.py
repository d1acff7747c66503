"""Turns each sampled token into a `RequestOutput` delta and decides whether the request is done.

Engine process, once per sampled token. Stop rules, in order: a stop token id (EOS unless
`ignore_eos`) once `min_tokens` were generated, stop strings on the detokenized text once more than
that (vLLM's rules), the P/D hand-off (a producer's request ends after its first token, whatever
`max_tokens` says), then `max_tokens` / the context length.
"""

from __future__ import annotations

from pdserve.engine.request import Request, RequestStatus, TransferState
from pdserve.outputs import RequestOutput, TokenLogprob
from pdserve.text.detokenizer import IncrementalDetokenizer, find_stop
from pdserve.text.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def start(self, request: Request) -> None:
        request.detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                               request.params.skip_special_tokens)

    def append(self, request: Request, token_id: int,
               logprob: TokenLogprob | None) -> tuple[RequestOutput, RequestStatus | None]:
        """Add one generated token. Returns the delta and the finished status (None: continue).
        A P/D producer's request stops after its first token unless a rule above already did."""
        request.output_token_ids.append(token_id)
        if request.logprobs is not None and logprob is not None:
            request.logprobs.append(logprob)
        new_text = request.detok.add(token_id)
        request.output_text += new_text
        status = None
        num_out = len(request.output_token_ids)
        if token_id in request.stop_token_ids and num_out >= request.params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
            if token_id in request.params.stop_token_ids:
                request.stop_reason = token_id
        elif request.params.stop and num_out > request.params.min_tokens and (
                hit := find_stop(request.output_text, len(new_text), request.params.stop)):
            stop, index = hit
            end = index + len(stop) if request.params.include_stop_str_in_output else index
            request.output_text = request.output_text[:end]
            request.stop_reason = stop
            status = RequestStatus.FINISHED_STOPPED
        elif request.transfer == TransferState.PRODUCING and request.num_tokens < self.max_model_len:
            # vLLM's rule: a producer hands off after its first token whatever max_tokens says
            # (vLLM's proxies send max_tokens 1); the decode instance continues from here.
            request.move_transfer_to(TransferState.HANDED_OFF)
            status = RequestStatus.FINISHED_LENGTH
        elif len(request.output_token_ids) >= request.max_tokens \
                or request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not isinstance(request.stop_reason, str):
            request.output_text += request.detok.flush()  # a stop string already cut the text
        out = self.delta(request, [token_id], [logprob] if request.logprobs is not None else None,
                         finished=status is not None)
        if status is not None:
            out.finish_reason = status.value
            out.stop_reason = request.stop_reason
        if len(request.output_token_ids) == 1:
            out.prompt_logprobs = request.prompt_logprobs
        return out, status

    def delta(self, request: Request, token_ids: list[int], logprobs: list | None,
              finished: bool) -> RequestOutput:
        """The text not yet emitted; while stop strings may still match, their possible start is held back."""
        visible = len(request.output_text)
        if not finished and request.params.stop:
            visible = max(request.num_emitted_chars,
                          visible - max(len(s) for s in request.params.stop) + 1)
        text = request.output_text[request.num_emitted_chars:visible]
        request.num_emitted_chars = visible
        return RequestOutput(
            request_id=request.request_id, new_token_ids=token_ids, new_text=text,
            new_logprobs=logprobs, finished=finished,
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=_cached_tokens(request),
            arrival_time=request.arrival_time, scheduled_time=request.scheduled_time)


def _cached_tokens(request: Request) -> int:
    """A P/D consumer reports what its producer found cached: the prompt was prefilled there (its
    own hits only spared READs), so the client sees what one instance would report."""
    kv = request.kv_transfer
    if kv is not None and kv.do_remote_prefill and kv.num_cached_tokens is not None:
        return kv.num_cached_tokens
    return request.num_cached_tokens
