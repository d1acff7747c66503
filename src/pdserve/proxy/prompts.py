"""The prompt of a client's request as the instances will see it: token ids (the same tokenizer,
template and rules as the server, text/prompts.py) and the content hashes of its full blocks.

Proxy process (event loop). A chat is encoded by pieces (pieces.py): a conversation's next turn
encodes only its new messages. A request the proxy cannot tokenize exactly (several prompts, a template the request brings,
anything malformed: the instance will judge it) has no ids; it is routed by load alone.
"""

from __future__ import annotations

from pdserve.health import PrefixCacheInfo
from pdserve.prefix_cache.hashing import event_hash, extra_keys, hash_blocks
from pdserve.proxy.pieces import PieceEncoder
from pdserve.text.prompts import chat_messages, template_tools, text_prompt_ids
from pdserve.text.tokenizer import Tokenizer


class PromptTokens:
    def __init__(self, model_dir: str, chat_template: str | None = None):
        """`chat_template`: the instances' `--chat-template`, where they were given one."""
        self.tokenizer = Tokenizer(model_dir, chat_template)
        self.pieces = PieceEncoder(self.tokenizer)  # as text/prompts.py's chat_prompt_ids, remembered

    def ids(self, body: dict, path: str) -> list[int] | None:
        try:
            ids = self._chat(body) if path.endswith("/chat/completions") else self._completion(body.get("prompt"))
        except Exception:  # noqa: BLE001 - a malformed request or template is the instance's to refuse
            return None
        # vLLM's truncate_prompt_tokens, cut as the instances cut it (server/serving.py). -1 (the
        # context's length, which the proxy does not know) is left uncut: only a prompt longer than
        # the context differs, routed by more blocks than it keeps (the count check counts it).
        k = body.get("truncate_prompt_tokens")
        if ids is not None and isinstance(k, int) and not isinstance(k, bool) and k >= 1:
            return ids[-k:]
        return ids

    def _completion(self, prompt) -> list[int] | None:
        if isinstance(prompt, str):
            return text_prompt_ids(self.tokenizer, prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            return list(prompt)
        return None

    def _chat(self, body: dict) -> list[int] | None:
        if body.get("chat_template") is not None or not isinstance(body.get("messages"), list):
            return None
        kwargs = body.get("chat_template_kwargs")
        text = self.tokenizer.apply_chat_template(
            chat_messages(body["messages"]), body.get("add_generation_prompt", True),
            continue_final_message=bool(body.get("continue_final_message", False)),
            template_kwargs=kwargs if isinstance(kwargs, dict) else None, tools=_tools(body))
        return self.pieces.encode(text)


def _tools(body: dict) -> list[dict] | None:
    """The tools the instance's template will see (server/tools.py): none under tool_choice "none"."""
    tools = body.get("tools")
    if not tools or body.get("tool_choice") == "none":
        return None
    return template_tools([t["function"] for t in tools])


def block_hashes(ids: list[int], info: PrefixCacheInfo, cache_salt) -> list[int]:
    """The 64-bit hashes (as in KV events) of the prompt's full blocks on instances hashing as
    `info` says (its model key and block size), under the request's salt."""
    salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
    return [event_hash(d) for d in hash_blocks(ids, info.block_size, extra_keys(info.model_key, salt))]
