"""`pdserve.LLM`: offline generation in vLLM's shape, driving one engine in this process."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from pdserve.checkpoints.gguf_file import checkpoint_dir
from pdserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.engine import Engine
from pdserve.model.generation_config import GenerationDefaults
from pdserve.outputs import CompletionOutput, GenerationOutput
from pdserve.sampling_params import InvalidRequestError, SamplingParams


class LLM:
    def __init__(self, model: str, tensor_parallel_size: int = 1, dtype: str = "auto",
                 quantization: str | None = None,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_gib: float = 1.0,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 max_model_len: int | None = None, num_threads: int | None = None, seed: int = 0,
                 chat_template: str | None = None, generation_config: str = "auto",
                 download_dir: str | None = None, kv_cache_dtype: str = "auto"):
        """`model`: a checkpoint directory or a .gguf file, converted once into `download_dir`
        (default ~/.cache/pdserve/gguf)."""
        model = checkpoint_dir(model, Path(download_dir) if download_dir else None)
        self.config = EngineConfig(
            model=model, dtype=dtype, quantization=quantization, seed=seed, max_model_len=max_model_len,
            num_threads=num_threads, chat_template=chat_template,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              kv_cache_gib=kv_cache_gib, kv_cache_dtype=kv_cache_dtype,
                              enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size))
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.defaults = GenerationDefaults.from_dir(model, generation_config)
        self._ids = itertools.count()

    def default_sampling_params(self) -> SamplingParams:
        """pdserve's defaults, overridden by the checkpoint's generation_config.json (as vLLM)."""
        d = self.defaults
        return SamplingParams(**{k: v for k, v in dataclasses.asdict(d).items() if v is not None})

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None) -> list[GenerationOutput]:
        """vLLM's `LLM.chat`: each conversation through the chat template, then `generate`."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            conv, add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template, template_kwargs=chat_template_kwargs), add_special_tokens=False)
            for conv in conversations]
        return self.generate(prompts, sampling_params)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[GenerationOutput]:
        """Run every prompt to completion (batched by the engine); results in prompt order.
        Prompts are strings or lists of token ids."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or self.default_sampling_params()
        params = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, GenerationOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            text = prompt if isinstance(prompt, str) else None
            token_ids = self.tokenizer.encode(prompt) if text is not None else list(prompt)
            request_id = str(next(self._ids))
            completions = []
            for i in range(p.n):
                sub = _child_params(p, i)
                sub_id = f"{request_id}-{i}"
                self.engine.add_request(sub_id, token_ids, sub)
                completions.append(CompletionOutput(i, "", [], [] if p.logprobs is not None else None,
                                                    None))
            results[request_id] = GenerationOutput(request_id, text, token_ids, completions)
            order.append(request_id)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                request_id, index = out.request_id.rsplit("-", 1)
                gen = results[request_id]
                comp = gen.outputs[int(index)]
                comp.text += out.new_text
                comp.token_ids.extend(out.new_token_ids)
                if comp.logprobs is not None and out.new_logprobs:
                    comp.logprobs.extend(out.new_logprobs)
                if out.finished:
                    comp.finish_reason = out.finish_reason
                    comp.stop_reason = out.stop_reason
                    gen.num_cached_tokens = out.num_cached_tokens
                    if out.error:
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return [results[r] for r in order]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sequence `index` of an n > 1 request: its own seed, so the n samples differ."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
