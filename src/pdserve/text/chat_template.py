"""Chat templates as checkpoints keep them today, rendered the way transformers renders them.

Server and engine processes. Where a template comes from, first match wins (vLLM's order):
`--chat-template` (a file or the template itself), `chat_template.jinja` in the checkpoint,
`chat_template` in `tokenizer_config.json` (a string, or a list of named templates whose "default"
is the default), then `chat_template.json`. Named templates also come from
`additional_chat_templates/*.jinja`. A request may pass its own template, or a template's name.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2.ext
import jinja2.sandbox

# Used when the checkpoint has no chat template (documented in the README).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


TEMPLATE_CACHE_SIZE = 64  # compiled templates kept (least recently used dropped first)
DEFAULT_MAX_CHARS = 1 << 20  # a sandboxed render's output bound when the caller gives none
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The template refused to render, or failed; `field` names what in the request caused it."""

    def __init__(self, message: str, field: str = "messages"):
        super().__init__(message)
        self.field = field


def find_templates(model_dir: Path, tokenizer_config: dict,
                   override: str | None = None) -> tuple[str | None, dict[str, str]]:
    """(the default template or None, named templates)."""
    named: dict[str, str] = {}
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        named.update({p.stem: p.read_text() for p in sorted(extra.glob("*.jinja"))})
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, list):
        named.update({t["name"]: t["template"] for t in configured if isinstance(t, dict)})
        configured = named.get("default")
    if override:
        path = Path(override)
        return (path.read_text() if path.is_file() else override), named
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), named
    if isinstance(configured, str):
        return configured, named
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        template = json.loads(json_file.read_text()).get("chat_template")
        if isinstance(template, str):
            return template, named
    return named.get("default"), named


class ChatRenderer:
    def __init__(self, default: str | None, named: dict[str, str], special_tokens: dict[str, str]):
        self.has_template = default is not None
        self.named = named
        self.special_tokens = special_tokens  # bos_token, eos_token, ... as the template expects
        env = environment()
        self._default = env.from_string(default or DEFAULT_CHAT_TEMPLATE)
        self._compile = functools.lru_cache(maxsize=TEMPLATE_CACHE_SIZE)(env.from_string)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               template_kwargs: dict | None = None, max_chars: int | None = None, sandbox=None,
               tools: list[dict] | None = None) -> str:
        """The prompt text, at most `max_chars` long. A template the request brings (`chat_template`
        that names none of the checkpoint's) renders in `sandbox` when one is given (a
        template_sandbox.TemplateSandbox; the server's, for its clients). Any error is a
        ChatTemplateError naming what caused it: the request's template (`chat_template`), else the
        request's `chat_template_kwargs` when the server's template renders without them, else the
        `messages`."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("add_generation_prompt and continue_final_message cannot both be true",
                                    "continue_final_message")
        kwargs = _checked(template_kwargs or {})
        base = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        if tools is not None:  # OpenAI's function tools, as vLLM hands them to templates
            base["tools"] = tools
        context = {**self.special_tokens, **kwargs, **base}
        from_request = chat_template is not None and chat_template not in self.named
        if from_request and sandbox is not None:
            text = sandbox.render(chat_template, context, max_chars or DEFAULT_MAX_CHARS)
        else:
            template = self._template(chat_template)
            try:
                text = render_text(template, context, max_chars)
            except Exception as e:  # noqa: BLE001 - a template runs arbitrary expressions
                raise ChatTemplateError(describe(e), self._blame(from_request, template, kwargs, base, max_chars)) \
                    from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text

    def num_compiled(self) -> int:
        return self._compile.cache_info().currsize

    def _blame(self, from_request: bool, template, kwargs: dict, base: dict, max_chars: int | None) -> str:
        if from_request:
            return "chat_template"
        if kwargs:
            try:
                render_text(template, {**self.special_tokens, **base}, max_chars)
                return "chat_template_kwargs"
            except Exception:  # noqa: BLE001 - the messages alone fail too
                pass
        return "messages"

    def _template(self, chat_template: str | None) -> jinja2.Template:
        if chat_template is None:
            return self._default
        try:
            return self._compile(self.named.get(chat_template, chat_template))
        except Exception as e:  # noqa: BLE001 - syntax errors, and anything else the parser raises
            raise ChatTemplateError(f"the chat template does not compile: {describe(e)}", "chat_template") from None


def render_text(template: jinja2.Template, context: dict, max_chars: int | None) -> str:
    """The rendered text, stopped as soon as it passes `max_chars` (None: no bound)."""
    parts, size = [], 0
    for part in template.generate(context):
        size += len(part)
        if max_chars is not None and size > max_chars:
            raise ChatTemplateError(f"the prompt would be longer than {max_chars} characters")
        parts.append(part)
    return "".join(parts)


def describe(e: Exception) -> str:
    """What a client reads: the template's own message (raise_exception), else the error's type and text."""
    if isinstance(e, ChatTemplateError | jinja2.TemplateError):
        return str(e)
    return f"{type(e).__name__}: {e}"


def _checked(kwargs: dict) -> dict:
    """The request's template variables; special tokens the templates concatenate must be text."""
    for name in SPECIAL_TOKENS:
        if name in kwargs and not isinstance(kwargs[name], str):
            raise ChatTemplateError(f"must be a string, got {type(kwargs[name]).__name__}",
                                    f"chat_template_kwargs.{name}")
    return kwargs


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """The prompt ends where the final message's content ends (its end-of-turn is cut)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise ChatTemplateError("continue_final_message: the final message's content is not in the prompt")
    at = text.rindex(final.strip())
    if text[at:at + len(final.lstrip())] == final.lstrip():
        return text[:at + len(final.lstrip())]
    return text[:at + len(final.strip())]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (marks assistant text for training): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ChatTemplateError(message)
