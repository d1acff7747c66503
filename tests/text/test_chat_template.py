"""Chat templates wherever today's checkpoints keep them: pdserve's prompt and answer equal
transformers' `apply_chat_template` + `generate`, for a template in chat_template.jinja, in
tokenizer_config.json (a string, or named templates), in additional_chat_templates/, from
`--chat-template`, or in the request itself."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from helpers import assert_greedy_match, hf_reference
from pdserve import SamplingParams

DEFAULT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYS] {{ m['content'] }}\n"
           "{% else %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<assistant>{% if think is defined and think %} think:"
           "{% endif %}{% endif %}")
TOOL_USE = ("{% for m in messages %}{% generation %}{{ m['role'] | upper }}: {{ m['content'] | tojson }}"
            "{% endgeneration %}\n{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
FLAG = "{% for m in messages %}{{ m['content'] }} | {% endfor %}{% if add_generation_prompt %}=>{% endif %}"
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "why is the cache \"paged\"?"}]

# placement -> (what save_pretrained is given, save_jinja_files)
PLACEMENTS = {
    "chat_template.jinja": (DEFAULT, True),
    "tokenizer_config string": (DEFAULT, False),
    "tokenizer_config named list": ({"default": DEFAULT, "tool_use": TOOL_USE}, False),
    "additional_chat_templates": ({"default": DEFAULT, "tool_use": TOOL_USE}, True),
}


def checkpoint(tiny_model: str, out: Path, template, jinja_files: bool) -> str:
    """The tiny model's weights with a tokenizer saved by transformers' own save_pretrained."""
    from transformers import AutoTokenizer
    out.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (Path(tiny_model) / name).exists():
            shutil.copy(Path(tiny_model) / name, out / name)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = template
    tok.save_pretrained(out, save_jinja_files=jinja_files)
    return str(out)


def hf_prompt(model_dir: str, **kw) -> list[int]:
    from transformers import AutoTokenizer
    out = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(MESSAGES, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_checkpoint_templates(placement, tiny_model, tmp_path, make_llm):
    model = checkpoint(tiny_model, tmp_path / "ckpt", *PLACEMENTS[placement])
    assert "chat_template" in Path(model, "tokenizer_config.json").read_text() or \
        Path(model, "chat_template.jinja").is_file()
    llm = make_llm(model, num_blocks=64)
    cases = [({}, {}), ({"think": True}, {"chat_template_kwargs": {"think": True}})]
    if isinstance(PLACEMENTS[placement][0], dict):
        cases.append(({"chat_template": "tool_use"}, {"chat_template": "tool_use"}))
    for hf_kw, ours_kw in cases:
        hf_ids = hf_prompt(model, add_generation_prompt=True, **hf_kw)
        out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10), **ours_kw)[0]
        assert out.prompt_token_ids == hf_ids, (placement, hf_kw)
        assert_greedy_match(out.outputs[0].token_ids, hf_reference(model, hf_ids, 10), placement)


def test_flag_and_request_templates_win(tiny_model, tmp_path, make_llm):
    model = checkpoint(tiny_model, tmp_path / "ckpt", DEFAULT, True)
    flag_file = tmp_path / "flag.jinja"
    flag_file.write_text(FLAG)
    llm = make_llm(model, num_blocks=64, chat_template=str(flag_file))
    hf_ids = hf_prompt(model, add_generation_prompt=True, chat_template=FLAG)
    assert llm.chat(MESSAGES, SamplingParams(max_tokens=1))[0].prompt_token_ids == hf_ids
    hf_ids = hf_prompt(model, add_generation_prompt=True, chat_template=TOOL_USE)
    out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8), chat_template=TOOL_USE)[0]
    assert out.prompt_token_ids == hf_ids


def test_continue_final_message(tiny_model, tmp_path, make_llm):
    model = checkpoint(tiny_model, tmp_path / "ckpt", DEFAULT, True)
    llm = make_llm(model, num_blocks=64)
    from transformers import AutoTokenizer
    messages = [*MESSAGES, {"role": "assistant", "content": "Because blocks"}]
    hf = AutoTokenizer.from_pretrained(model).apply_chat_template(
        messages, tokenize=False, continue_final_message=True)
    ours = llm.tokenizer.apply_chat_template(messages, False, continue_final_message=True)
    assert ours == hf and ours.endswith("Because blocks")


def test_generation_config_defaults(tmp_path, caplog):
    """As vLLM applies generation_config.json: unset request fields take its values."""
    from transformers import GenerationConfig

    from pdserve.model.generation_config import GenerationDefaults
    from pdserve.server.protocol import ChatCompletionRequest
    from pdserve.server.serving import BaseServing
    GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=77, repetition_penalty=1.1,
                     do_sample=True, eos_token_id=[2, 5]).save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        defaults = GenerationDefaults.from_dir(tmp_path)
    assert defaults == GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=77,
                                          repetition_penalty=1.1)
    assert GenerationDefaults.from_dir(tmp_path, "vllm") == GenerationDefaults()
    serving = BaseServing(None, "m", None, defaults)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    p = serving.sampling_params(req, None, None)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens, p.repetition_penalty) == (0.6, 0.9, 20, 77, 1.1)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.0, top_k=-1)
    p = serving.sampling_params(req, 5, None)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 0, 5)


# --- errors: a template error caused by the request names the request's field (fast, no engine) ---

TOOLS = ("{% for t in tools %}[{{ t['name'] }}]{% endfor %}{% for m in messages %}{{ m['role'] }}: "
         "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
STRICT = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be a user') }}" \
         "{% endif %}" + TOOLS
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
USER = [{"role": "user", "content": "hi"}]


def renderer(default: str = TOOLS):
    from pdserve.text.chat_template import ChatRenderer
    return ChatRenderer(default, {}, SPECIAL)


def refused_field(**kw) -> str:
    from pdserve.text.chat_template import ChatTemplateError
    r = kw.pop("renderer", None) or renderer()
    with pytest.raises(ChatTemplateError) as e:
        r.render(kw.pop("messages", USER), **kw)
    return e.value.field


@pytest.mark.parametrize("template", ["{{ 1/0 }}", "{{ messages[5]['role'] }}", "{{ messages + 1 }}",
                                      "{% for %}", "{{ raise_exception('no') }}", "{{ messages.pop() }}"])
def test_any_error_of_a_request_template_names_chat_template(template):
    assert refused_field(chat_template=template) == "chat_template"


def test_kwargs_that_break_the_server_template_name_chat_template_kwargs():
    assert refused_field(template_kwargs={"tools": 5}) == "chat_template_kwargs"
    assert "[f]" in renderer().render(USER, template_kwargs={"tools": [{"name": "f"}]})


def test_messages_the_server_template_refuses_name_messages():
    strict = renderer(STRICT)
    assert refused_field(renderer=strict, messages=[{"role": "assistant", "content": "x"}]) == "messages"
    # ... even when kwargs were sent too, if the messages alone are refused
    assert refused_field(renderer=strict, messages=[{"role": "assistant", "content": "x"}],
                         template_kwargs={"tools": []}) == "messages"


# --- request templates run bounded: time, output, memory, compile cache (fast, no engine) ---

NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
WIDE = "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
HUGE = "{{ 'x' * 4000000000 }}"
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{{ ns.s | length }}")


@pytest.fixture(scope="module")
def sandbox():
    from pdserve.text.template_sandbox import TemplateSandbox
    box = TemplateSandbox(timeout_s=2.0)
    yield box
    box.close()


def sandboxed(sandbox, template: str, max_chars: int = 100_000, **kw) -> str:
    return renderer().render(USER, chat_template=template, sandbox=sandbox, max_chars=max_chars, **kw)


@pytest.mark.parametrize("template, what", [(NESTED, "longer than"), ("{% for i in range(10**9) %}{% endfor %}", ""),
                                            (WIDE, "characters"), (HUGE, "memory"), (DOUBLING, "memory")])
def test_a_request_template_that_would_run_away_is_refused_quickly(sandbox, template, what):
    from pdserve.text.chat_template import ChatTemplateError
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as e:
        sandboxed(sandbox, template)
    assert e.value.field == "chat_template" and what in str(e.value), str(e.value)
    assert time.monotonic() - start < 5.0
    # the sandbox serves the next template as if nothing had happened
    assert sandboxed(sandbox, "{{ bos_token }}{{ messages[0]['content'] }}") == "<s>hi"


def test_a_request_template_renders_as_in_process(sandbox):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why \"paged\"?"}]
    for template, kwargs in [(TOOLS, {"tools": [{"name": "f"}]}), (TOOL_USE, None), (DEFAULT, {"think": True})]:
        here = renderer().render(messages, chat_template=template, template_kwargs=kwargs)
        there = renderer().render(messages, chat_template=template, template_kwargs=kwargs, sandbox=sandbox,
                                  max_chars=10_000)
        assert there == here and here


def test_the_output_bound_holds_for_the_servers_template_too():
    from pdserve.text.chat_template import ChatTemplateError
    with pytest.raises(ChatTemplateError) as e:
        renderer().render([{"role": "user", "content": "y" * 5000}], max_chars=1000)
    assert e.value.field == "messages" and "1000 characters" in str(e.value)


def test_the_compile_cache_is_bounded():
    from pdserve.text.chat_template import TEMPLATE_CACHE_SIZE
    r = renderer()
    for i in range(TEMPLATE_CACHE_SIZE + 50):
        assert r.render(USER, chat_template=f"{{{{ {i} }}}}") == str(i)
    assert r.num_compiled() == TEMPLATE_CACHE_SIZE


@pytest.mark.parametrize("name", ["bos_token", "eos_token", "pad_token", "unk_token"])
def test_special_tokens_in_kwargs_must_be_strings(name):
    for value in ({"x": 1}, 5, ["<s>"], None):
        assert refused_field(template_kwargs={name: value}) == f"chat_template_kwargs.{name}"
    assert renderer(DEFAULT).render(USER, template_kwargs={"bos_token": "<B>"}).startswith("<B>")
