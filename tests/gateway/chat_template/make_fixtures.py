#!/usr/bin/env python3
"""Renders the checked-in chat templates with python3-jinja2 exactly as Hugging Face
transformers' apply_chat_template does, over a fixed set of conversations, and writes
fixtures.json. chat_template_fixtures_test (C++) renders the same cases with
tandem::chat_template and must produce the same bytes, or the same error message.

  make_fixtures.py            rewrite fixtures.json next to this script
  make_fixtures.py --check    exit 1 if fixtures.json differs from a fresh rendering,
                              77 (ctest: skipped) if jinja2 is not installed

The transformers setup copied here (transformers/utils/chat_template_utils.py,
_compile_jinja_template): ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[AssistantTracker, jinja2.ext.loopcontrols]), tojson = json.dumps with
ensure_ascii=False, globals raise_exception (raises TemplateError(message)) and strftime_now;
render(messages=..., tools=..., documents=..., add_generation_prompt=..., **special_tokens,
**kwargs). No template here uses {% generation %}, so AssistantTracker is not needed.

Messages pass through the same normalisation as tandem's RenderChat (as vLLM does): a content
list of text parts is joined with "\\n"; an assistant tool call's JSON-string arguments are
parsed into an object.
"""
import argparse
import copy
import json
import os
import sys
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Where each template's text comes from (repository, path, commit); the .jinja files hold the
# decoded text byte for byte.
TEMPLATES = {
    "llama3_1": {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tools": True,
        "source": "meta-llama/Meta-Llama-3.1-8B-Instruct chat_template, as quoted in "
                  "huggingface/text-generation-inference router/src/infer/chat_template.rs "
                  "@0275c52cbdfb3ce619d9cf7323e5acc41027bbe7 "
                  "(test_chat_template_with_custom_tool_template)",
    },
    "llama3_2": {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tools": True,
        "source": "meta-llama/Llama-3.2-3B-Instruct, ggerganov/llama.cpp "
                  "models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja "
                  "@7b5e0803c84435e8005725d8f9ddceb5d1820443",
    },
    "llama3": {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "tools": False,
        "source": "meta-llama/Meta-Llama-3-8B-Instruct, as quoted (with that tokenizer_config.json "
                  "URL) in abetlen/llama-cpp-python llama_cpp/llama_chat_format.py "
                  "@001fbb467a5fb22302b7e02ca40910aa3c18b885 (LLAMA3_INSTRUCT_CHAT_TEMPLATE)",
    },
    "qwen2_5": {
        "bos_token": "", "eos_token": "<|im_end|>", "tools": True,
        "source": "Qwen2.5-Instruct tokenizer_config.json chat_template, as quoted in "
                  "HuanzhiMao/gorilla berkeley-function-call-leaderboard/bfcl/model_handler/"
                  "oss_model/qwen_fc.py @4ff43b37f25075a12ad94eb1b3aecdd5662c61eb",
    },
    "qwen3": {
        "bos_token": "", "eos_token": "<|im_end|>", "tools": True,
        "source": "Qwen/Qwen3-0.6B tokenizer_config.json chat_template (thinking tags, "
                  "enable_thinking, reasoning_content), ggerganov/llama.cpp "
                  "models/templates/Qwen-Qwen3-0.6B.jinja as stored in the fork ye-NX/llama.cpp "
                  "@b354d7c9ecb76c97c07098617cdebbdfffa2583e (line ends as LF)",
    },
    "chatml_openhermes": {
        "bos_token": "<s>", "eos_token": "<|im_end|>", "tools": False,
        "source": "teknium/OpenHermes-2.5-Mistral-7B (ChatML), ggerganov/llama.cpp "
                  "tests/test-chat-template.cpp @037af53bfa603770fd93c91508df4379e4b7d6e2",
    },
    "mistral_v0_1": {
        "bos_token": "<s>", "eos_token": "</s>", "tools": False,
        "source": "mistralai/Mistral-7B-Instruct-v0.1, abetlen/llama-cpp-python "
                  "llama_cpp/llama_chat_format.py @001fbb467a5fb22302b7e02ca40910aa3c18b885 "
                  "(MISTRAL_INSTRUCT_CHAT_TEMPLATE); the same text is in huggingface/huggingface.js "
                  "packages/jinja/test/e2e.test.js @029db6baefd46bedd8900dd2ba4aa1eb03a9ef3d",
    },
    "mistral_v0_2": {
        "bos_token": "<s>", "eos_token": "</s>", "tools": False,
        "source": "mistralai/Mistral-7B-Instruct-v0.2, ggerganov/llama.cpp "
                  "tests/test-chat-template.cpp @037af53bfa603770fd93c91508df4379e4b7d6e2; the same "
                  "text is Mixtral-8x7B-Instruct-v0.1's in abetlen/llama-cpp-python "
                  "llama_cpp/llama_chat_format.py @001fbb467a5fb22302b7e02ca40910aa3c18b885",
    },
    "mistral_nemo_2407": {
        "bos_token": "<s>", "eos_token": "</s>", "tools": True,
        "source": "mistralai/Mistral-Nemo-Instruct-2407 (the v3 tool-calling template family of "
                  "Mistral-7B-Instruct-v0.3), ggerganov/llama.cpp "
                  "models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja "
                  "@7b5e0803c84435e8005725d8f9ddceb5d1820443",
    },
    "gemma_7b_it": {
        "bos_token": "<bos>", "eos_token": "<eos>", "tools": False,
        "source": "google/gemma-7b-it, ggerganov/llama.cpp tests/test-chat-template.cpp "
                  "@037af53bfa603770fd93c91508df4379e4b7d6e2",
    },
    "hermes_vllm": {
        "bos_token": "<s>", "eos_token": "<|im_end|>", "tools": True,
        "source": "vLLM's Hermes-2-Pro tool-use template, vllm-project/vllm "
                  "examples/tool_chat_template_hermes.jinja @66aa580a8fe3c6d73fdecc9abb387f5dcf33a321",
    },
    "deepseek_r1_distill": {
        "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "tools": True,
        "source": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B, ggerganov/llama.cpp "
                  "models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja "
                  "@db502ddd0edeca9bcde774b3a4cac4b6ec45d02f",
    },
    "phi3_5_mini": {
        "bos_token": "<s>", "eos_token": "<|endoftext|>", "tools": False,
        "source": "microsoft/Phi-3.5-mini-instruct, ggerganov/llama.cpp "
                  "models/templates/microsoft-Phi-3.5-mini-instruct.jinja "
                  "@7b5e0803c84435e8005725d8f9ddceb5d1820443",
    },
}

WEATHER_TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}, {
    "type": "function",
    "function": {
        "name": "search_notes",
        "description": "Search the user's notes ",
        "parameters": {
            "type": "object",
            "properties": {
                "terms": {"type": "array", "items": {"type": "string"}, "description": "Words to look for"},
                "limit": {"type": ["integer", "null"], "description": "At most this many"},
                "filters": {"type": "object", "additionalProperties": {"type": "boolean"},
                            "description": "Tag filters"},
                "score": {"type": "number", "description": "Minimum score ≥ 0.5"},
            },
            "required": ["terms"],
        },
        "return": {"type": "array", "description": "The matching notes"},
    },
}]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello, how are you?"}],
    "system_user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Who are you"},
        {"role": "assistant", "content": "   I am an assistant   "},
        {"role": "user", "content": "Another question"},
    ],
    "multi_turn_no_system": [
        {"role": "user", "content": "Write a haiku."},
        {"role": "assistant", "content": "Leaves fall in silence\nthe pond keeps its own counsel\nwind writes, then erases"},
        {"role": "user", "content": "Another one, about \"quotes\" and {braces} and {{ tags }}."},
    ],
    "non_ascii": [
        {"role": "user", "content": "Grüß dich! 你好 🎉 — café\ttab"},
        {"role": "assistant", "content": "Ça va? ✓ Привет"},
        {"role": "user", "content": "  ¿Qué tal?  "},
    ],
    "content_parts": [
        {"role": "user", "content": [{"type": "text", "text": "First part."},
                                     {"type": "text", "text": "Second part."}]},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Hi!"},
    ],
    "reasoning_history": [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>Add them.</think>\n\n4"},
        {"role": "user", "content": "And 3 + 3?"},
    ],
    "not_alternating": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
}

TOOL_CONVERSATIONS = {
    "tools_question": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "What's the weather like in Oslo?"},
    ],
    "tools_round_trip": [
        {"role": "user", "content": "What's the weather like in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call12345", "type": "function",
            "function": {"name": "get_current_weather",
                         "arguments": "{\"location\": \"Oslo, Norway\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call12345", "content": "{\"temperature\": -3.5, \"sky\": \"snow ❄\"}"},
    ],
    "tools_named_results": [
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"id": "callOslo1", "type": "function",
             "function": {"name": "get_current_weather", "arguments": "{\"location\": \"Oslo\"}"}},
            {"id": "callBrgn2", "type": "function",
             "function": {"name": "get_current_weather", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "callOslo1", "name": "get_current_weather", "content": "-3 C"},
        {"role": "tool", "tool_call_id": "callBrgn2", "name": "get_current_weather", "content": "4 C"},
        {"role": "assistant", "content": "Oslo -3 C, Bergen 4 C."},
        {"role": "user", "content": "Thanks"},
    ],
}


# Engine snippets: (name, template, context), rendered with Template::Render.
SNIPPETS = [
 ("trim_lstrip_blocks", "{% for x in xs %}\n  {% if x %}\n    [{{ x }}]\n  {% endif %}\n{% endfor %}\ndone\n", {"xs": [1, 0, 2]}),
 ("dash_strips", "a  \n  {%- if true -%}  \n b {{- ' c ' -}}  d\n{%- endif %}{{ 'e' }}", {}),
 ("plus_keeps_indent", "x\n    {%+ if true %}y{% endif %}", {}),
 ("comments", "a\n  {# note #}\nb{#- x -#}  c", {}),
 ("var_tags_not_trimmed", "{{ 'a' }}\n{{ 'b' }}\n", {}),
 ("loop_vars", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}", {}),
 ("for_else_filter", "{% for x in xs if x > 1 %}{{ x }}/{{ loop.length }} {% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
 ("unpack_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in d | items %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": [1, "x"]}}),
 ("break_continue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
 ("scoping", "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = i * 10 %}{{ x }} {% endfor %}{{ x }}{% if true %}{% set x = 7 %}{% endif %}{{ x }}", {}),
 ("namespace", "{% set ns = namespace(n=0, seen=[]) %}{% for m in msgs %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", {"msgs": [{}, {}, {}]}),
 ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bo', punct='?') }}", {}),
 ("set_block", "{% set body %}x={{ 1 + 2 }}{% endset %}[{{ body }}]", {}),
 ("arith", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 6 / 3 }} {{ 2 ** 10 }} {{ 1.5 + 1 }} {{ 0.1 + 0.2 }} {{ 1e-5 }} {{ 1e16 }} {{ 3 * 'ab' }} {{ 'x' ~ 1 ~ none ~ true }}", {}),
 ("compare_in", "{{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 'b' in 'abc' }} {{ 2 not in [1, 3] }} {{ 'k' in {'k': 1} }} {{ none is none }} {{ true == 1 }}", {}),
 ("and_or_values", "{{ 0 or 'x' }} {{ 'a' and 'b' }} {{ [] or none }} {{ not [] }} {{ 'y' if 0 else 'n' }}", {}),
 ("slices", "{{ s[::-1] }} {{ s[1:3] }} {{ s[-2:] }} {{ l[::2] }} {{ l[-1] }} {{ s[0] }} {{ l[5] is defined }}", {"s": "héllo", "l": [1, 2, 3, 4, 5]}),
 ("strings_methods", "{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'hello world'.title() }}|{{ 'aBc'.upper() }}{{ 'aBc'.lower() }}|{{ 'abab'.replace('a', 'x', 1) }}", {}),
 ("dict_methods", "{{ d.get('a') }} {{ d.get('z', 'dflt') }} {{ d.get('z') }} {{ d.keys() | list }} {{ d.values() | list }} {{ d['a'] }} {{ d.a }}", {"d": {"a": 1, "b": "two"}}),
 ("filters_text", "{{ '  pad  ' | trim }}|{{ 'héllo' | length }}|{{ 'hello world-wide' | title }}|{{ 'hELLO' | capitalize }}|{{ 'a' | upper }}|{{ x | default('d') }}|{{ '' | default('e', true) }}|{{ [1, 2] | join(', ') }}|{{ 5 | string }}|{{ '42' | int + 1 }}|{{ 'x' | int }}|{{ 'a-b' | replace('-', '+') }}", {}),
 ("filters_seq", "{{ l | first }} {{ l | last }} {{ l | length }} {{ 'ab' | list }} {{ [3, 1, 3] | unique | list }} {{ [1, 2] | reverse | list }} {{ l | count }}", {"l": [4, 5, 6]}),
 ("select_map", "{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(',') }}|{{ ms | rejectattr('role', 'equalto', 'user') | list | length }}|{{ [0, 1, 2] | select | list }}|{{ ms | map(attribute='missing', default='-') | join }}|{{ ['a', 'b'] | map('upper') | join }}", {"ms": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]}),
 ("tojson", "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ v | tojson(sort_keys=true) }}|{{ v | tojson(separators=(',', ':')) }}|{{ 'é\"\\\\\\n\\u0001' | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}|{{ [] | tojson(indent=2) }}", {"v": {"b": [1, 2.5, None, True], "a": {}, "c": "ü"}}),
 ("tests", "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ x is string }}{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ 1.0 is float }}{{ {} is mapping }}{{ [] is sequence }}{{ 'a' is iterable }}{{ 3 is odd }}{{ 4 is even }}{{ 6 is divisibleby 3 }}{{ x is not none }}{{ 'a' is equalto 'a' }}{{ 'ab' is lower }}", {"x": "s"}),
 ("undefined_soft", "[{{ nope }}][{{ nope | length }}][{% for x in nope %}x{% endfor %}][{{ nope is iterable }}][{{ d.missing }}][{{ l[9] }}][{{ nope ~ 'x' }}]", {"d": {}, "l": []}),
 ("python_repr", "{{ [1, 'a', none, true, 1.5, {'k': \"it's\"}] }}|{{ {'a': [1]} }}|{{ none }}|{{ false }}", {}),
 ("cond_no_else", "[{{ 'x' if false }}]", {}),
 ("loop_cycle_prev", "{% for x in [1, 2, 3] %}{{ loop.cycle('a', 'b') }}{% if not loop.first %}{{ loop.previtem }}{% endif %}{% endfor %}", {}),
 ("string_escapes", "{{ 'a\\tb\\\\n\\x41\\u00e9' }}|{{ \"q'\" }}|{{ 'x' 'y' }}", {}),
 ("dict_literal", "{% set d = {'a': 1, 'b': [1, 2]} %}{{ d.b[1] }}{{ dict(x=1, y=2) | tojson }}", {}),
 ("crlf_and_trailing", "a\r\nb{% if true %}\r\nc{% endif %}\n", {}),
 ("ws_block_at_start", "  {% if true %}\n  x\n  {% endif %}\n  y", {}),
 ("ws_dash_var", "a\n\n  {{- 'b' -}}\n\n  c\n{{ 'd' -}}   \n e", {}),
 ("ws_comment_line", "a\n    {#- c #}\n    {# d -#}\n\nb", {}),
 ("ws_nested_blocks", "{% for m in ms %}\n    {%- if m %}\n        <{{ m }}>\n    {%- endif %}\n{% endfor %}\n", {"ms": ["a", "", "b"]}),
 ("ws_text_only_newlines", "\n\n{% if true %}\n\n{% endif %}\n\n", {}),
 ("loop_more", "{% for x in [1, 2, 3] %}{{ loop.revindex0 }}{% if not loop.last %}{{ loop.nextitem }}{% endif %}{{ loop.depth }},{% endfor %}", {}),
 ("tuple_set", "{% set a, b = [1, 2] %}{% set (c, d) = 'xy' %}{{ a }}{{ b }}{{ c }}{{ d }}", {}),
 ("float_repr", "{{ 1e100 }} {{ -0.0 }} {{ 1.0 }} {{ 3.14 }} {{ 123456789012345678.0 }} {{ 0.0001 }} {{ 2.5e-7 }} {{ [1.5, 2.0] | tojson }} {{ 1e16 | tojson }}", {}),
 ("dict_filters", "{{ d | length }} {{ d | list }} {{ d | first }} {{ d is sequence }} {{ 5 is iterable }} {{ d is mapping }} {{ 'x' is sequence }}", {"d": {"k1": 1, "k2": 2}}),
 ("macro_namespace", "{% macro count(xs) %}{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}{% endfor %}{{ ns.n }}{% endmacro %}{{ count([1, 2, 3]) }}|{{ count([]) }}", {}),
 ("unicode_compare", "{{ 'é' > 'z' }} {{ 'ab' < 'abc' }} {{ ['b'] > ['a', 'z'] }} {{ 'ÄbC' | lower }} {{ 'x' | center if false else 'ok' }}", {}),
 ("content_checks", "{% for m in ms %}{{ m.content is string }}{{ m.content is none }}{{ m.get('name', 'anon') }};{% endfor %}", {"ms": [{"content": "a"}, {"content": None, "name": "n"}]}),
 ("neg_index_slices", "{{ l[-1] }}{{ l[:-1] }}{{ l[1:] }}{{ l[::-1] }}{{ l[10:] }}{{ l[-10:2] }}{{ 'abc'[1:] }}{{ 'abc'[::-2] }}", {"l": [1, 2, 3]}),
 ("int_filters", "{{ '  12 ' | int }} {{ '3.9' | int }} {{ 4.7 | int }} {{ true | int }} {{ 'x' | int(-1) }} {{ '2.5' | float }} {{ 3 | float }} {{ -3 | abs }}", {}),
 ("join_attr", "{{ ms | join(', ', attribute='role') }}|{{ [1, none, 'a'] | join('-') }}", {"ms": [{"role": "user"}, {"role": "assistant"}]}),
 ("err_div_zero", "{{ 1 // 0 }}", {}),
 ("err_truediv_zero", "{{ 1 / 0 }}", {}),
 ("err_mod_zero", "{{ 1 % 0 }}", {}),
 ("err_none_plus", "{{ none + 1 }}", {}),
 ("err_list_plus_str", "{{ [1] + 'a' }}", {}),
 ("err_in_none", "{{ 'a' in none }}", {}),
 ("err_compare", "{{ 'a' < 1 }}", {}),
 ("err_empty_index", "{{ messages[-1].role }}", {"messages": []}),
 ("err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}", {}),
 ("err_undefined_call", "{{ nothing() }}", {}),
 ("err_not_callable", "{{ 'abc'() }}", {}),
 ("raw_blocks", "a {% raw %}{{ not rendered }} {% if %}{% endraw %} b\n  {%- raw -%}  x  {%- endraw %}\nc{% raw %}\n{{ y }}\n{% endraw %}\nd", {}),
 ("sort_filters", "{{ [3, 1, 2] | sort }} {{ ['b', 'A', 'c'] | sort }} {{ ['b', 'A', 'c'] | sort(case_sensitive=true) }} {{ [1, 3, 2] | sort(reverse=true) }} {{ ms | sort(attribute='n') | map(attribute='n') | list }} {{ d | dictsort }} {{ d | dictsort(by='value', reverse=true) }}", {"ms": [{"n": 2}, {"n": 1}, {"n": 3}], "d": {"b": 1, "a": 3, "C": 2}}),
 ("min_max_sum", "{{ [3, 1, 2] | min }} {{ [3, 1, 2] | max }} {{ ['b', 'A'] | max }} {{ ms | max(attribute='n') }} {{ [1, 2.5] | sum }} {{ ms | sum(attribute='n', start=10) }} [{{ [] | min }}]", {"ms": [{"n": 2}, {"n": 1}, {"n": 3}]}),
 ("float_floordiv", "{{ 2 // 0.1 }} {{ 2 % 0.1 }} {{ -7.5 // 2 }} {{ 7.5 % -2 }} {{ -0.0 // 1 }} {{ 5 // -2.0 }}", {}),
 ("percent_format", "{{ '%s-%d %r %%' % ('a', 3.9, 'q') }} {{ '%s!' % 5 }} {{ 'none' % [1] }}", {}),
 ("unicode_names", "{% set é = 'accent' %}{{ é }}{% for ü in [1] %}{{ ü }}{% endfor %}", {}),
 ("comment_at_end", "text{#", {}),
 # Errors: jinja2's message must appear in tandem's error (syntax errors: any syntax error).
 ("err_concat", "{{ 'a' + 1 }}", {}),
 ("err_undefined_attr", "line1\n{{ foo.bar }}", {}),
 ("err_missing_attr", "{{ d.x.y }}", {"d": {}}),
 ("err_raise", "{% if true %}{{ raise_exception('Custom refusal: ' ~ n) }}{% endif %}", {"n": 3}),
 ("err_not_iterable", "{% for x in 5 %}{% endfor %}", {}),
 ("err_syntax_unclosed", "{% if x %}open", {}),
 ("err_syntax_unknown_tag", "{% frobnicate %}", {}),
 ("err_syntax_bad_expr", "{{ 1 + }}", {}),
]


def normalize(messages):
    """RenderChat's (and vLLM's) message normalisation."""
    out = copy.deepcopy(messages)
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "\n".join(p["text"] for p in m["content"])
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            for call in m["tool_calls"]:
                fn = call.get("function")
                if not isinstance(fn, dict):
                    continue
                args = fn.get("arguments")
                if not args:
                    fn["arguments"] = {}
                elif isinstance(args, str):
                    fn["arguments"] = json.loads(args)
    return out


def make_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def build():
    env = make_env()
    cases = []
    for name, info in TEMPLATES.items():
        with open(os.path.join(HERE, "templates", name + ".jinja"), encoding="utf-8") as f:
            template = env.from_string(f.read())
        convs = dict(CONVERSATIONS)
        if info["tools"]:
            convs.update(TOOL_CONVERSATIONS)
        for conv_name, messages in convs.items():
            variants = [(True, None)]
            variants.append((False, None))
            if conv_name.startswith("tools_"):
                variants = [(True, WEATHER_TOOLS), (False, WEATHER_TOOLS), (True, WEATHER_TOOLS[:1])]
                if conv_name == "tools_round_trip":
                    variants.append((True, None))  # a replayed call without tools offered
            for add_generation_prompt, tools in variants:
                # Fixed date so fixtures never depend on the day they were made.
                extra = {"date_string": "25 Nov 2026"} if name == "llama3_2" else {}
                case = {
                    "template": name,
                    "name": "%s/%s/%s" % (conv_name, "gen" if add_generation_prompt else "nogen",
                                          ("tools%d" % len(tools)) if tools else "notools"),
                    "messages": messages,
                    "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": info["bos_token"],
                    "eos_token": info["eos_token"],
                    "extra": extra,
                }
                try:
                    case["expected"] = template.render(
                        messages=normalize(messages), tools=tools, documents=None,
                        add_generation_prompt=add_generation_prompt,
                        bos_token=info["bos_token"], eos_token=info["eos_token"], **extra)
                except Exception as e:  # the template refused the conversation
                    case["error"] = str(e)
                cases.append(case)
        # Qwen3's thinking switch (chat_template_kwargs {"enable_thinking": false}: an empty
        # think block after the generation prompt) and an assistant turn carrying its reasoning
        # in reasoning_content instead of <think> tags (after the last user turn: rendered
        # inside <think>; before it: dropped).
        if name == "qwen3":
            thinking = {
                "reasoning_field": [
                    {"role": "user", "content": "2 + 2?"},
                    {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                    {"role": "user", "content": "And 3 + 3?"},
                    {"role": "assistant", "content": "6", "reasoning_content": "\nAdd again.\n"},
                ],
            }
            for conv_name, messages in list(CONVERSATIONS.items()) + list(thinking.items()):
                for extra in ({"enable_thinking": False}, {"enable_thinking": True}):
                    if conv_name in thinking and extra["enable_thinking"]:
                        continue
                    case = {"template": name,
                            "name": "%s/gen/notools/thinking_%s" % (
                                conv_name, "on" if extra["enable_thinking"] else "off"),
                            "messages": messages, "tools": None, "add_generation_prompt": True,
                            "bos_token": info["bos_token"], "eos_token": info["eos_token"],
                            "extra": extra}
                    try:
                        case["expected"] = template.render(
                            messages=normalize(messages), tools=None, documents=None,
                            add_generation_prompt=True, bos_token=info["bos_token"],
                            eos_token=info["eos_token"], **extra)
                    except Exception as e:
                        case["error"] = str(e)
                    cases.append(case)
            messages = thinking["reasoning_field"]
            case = {"template": name, "name": "reasoning_field/nogen/notools", "messages": messages,
                    "tools": None, "add_generation_prompt": False, "bos_token": info["bos_token"],
                    "eos_token": info["eos_token"], "extra": {}}
            case["expected"] = template.render(
                messages=normalize(messages), tools=None, documents=None,
                add_generation_prompt=False, bos_token=info["bos_token"],
                eos_token=info["eos_token"])
            cases.append(case)
        # Llama 3.1's built-in tools (ipython mode): python_tag calls and <|eom_id|>.
        if name == "llama3_1":
            messages = [
                {"role": "system", "content": "Answer with search results."},
                {"role": "user", "content": "Who won the 2023 Tour de France?"},
                {"role": "assistant", "tool_calls": [{"id": "call00001", "type": "function", "function": {
                    "name": "brave_search", "arguments": "{\"query\": \"2023 Tour de France winner\"}"}}]},
                {"role": "ipython", "content": [{"type": "text", "text": "Jonas Vingegaard won."}]},
            ]
            extra = {"builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]}
            case = {"template": name, "name": "builtin_tools/gen/notools", "messages": messages,
                    "tools": None, "add_generation_prompt": True, "bos_token": info["bos_token"],
                    "eos_token": info["eos_token"], "extra": extra}
            case["expected"] = template.render(
                messages=normalize(messages), tools=None, documents=None, add_generation_prompt=True,
                bos_token=info["bos_token"], eos_token=info["eos_token"], **extra)
            cases.append(case)
    import fuzz_snippets
    sources, fuzz_context = fuzz_snippets.programs(seed=13, count=1500)
    named = [(n, t, c) for n, t, c in SNIPPETS]
    for i, source in enumerate(sources):
        if any(skip in source for skip in fuzz_snippets.SKIP):
            continue
        try:
            env.from_string(source).render(**fuzz_context)
        except Exception:
            continue  # error wording depends on evaluation order; the named snippets check errors
        named.append(("random%d" % i, source, None))
    snippets = []
    for name, source, context in named:
        entry = {"name": name, "template": source}
        if context is None:
            context = fuzz_context  # stored once, as "random_context"
        else:
            entry["context"] = context
        try:
            entry["expected"] = env.from_string(source).render(**context)
        except Exception as e:
            entry["error"] = str(e)
            entry["syntax_error"] = type(e).__name__ == "TemplateSyntaxError"
        snippets.append(entry)
    return {
        "comment": "Generated by make_fixtures.py with python3-jinja2; do not edit by hand. "
                   "Template sources are under 'templates'.",
        "templates": {name: {"file": "templates/%s.jinja" % name, "source": info["source"]}
                      for name, info in TEMPLATES.items()},
        "cases": cases,
        "snippets": snippets,
        "random_context": fuzz_context,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--output", default=os.path.join(HERE, "fixtures.json"))
    args = parser.parse_args()
    try:
        import jinja2  # noqa: F401
    except ImportError:
        print("SKIP: python3-jinja2 is not installed")
        return 77 if args.check else 1
    text = json.dumps(build(), ensure_ascii=False, indent=1) + "\n"
    if args.check:
        with open(args.output, encoding="utf-8") as f:
            current = f.read()
        if current != text:
            print("fixtures.json is stale: run tests/gateway/chat_template/make_fixtures.py")
            return 1
        print("fixtures.json is up to date")
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
