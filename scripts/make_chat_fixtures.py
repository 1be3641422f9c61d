"""Reference renderings of chat templates by transformers' Jinja2 environment.

Writes mlx-k3/tests/fixtures/chat/templates.json: for each case a template (written for this project to
exercise what real chat templates use: whitespace control, namespaces, slicing, Python string and dict
methods, `tojson` with and without indent, tool definitions and tool calls, `raise_exception`), the
variables passed, and the text transformers renders (or the exception message it raises). The Rust test
`tests/chat.rs` renders the same cases with minijinja and must produce identical text.

Run: .venv/bin/python scripts/make_chat_fixtures.py  (needs transformers, which mlx-lm installs)
"""

import json
from pathlib import Path

import transformers
from transformers.utils.chat_template_utils import _compile_jinja_template

OUT = Path(__file__).resolve().parent.parent / "mlx-k3/tests/fixtures/chat/templates.json"

CHATML = """{%- for message in messages %}
    {%- if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

HEADERS = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0].role == 'system' %}
    {%- set ns.system = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set rest = messages %}
{%- endif %}
{%- if ns.system %}
<|start_header_id|>system<|end_header_id|>

{{ ns.system | trim }}<|eot_id|>
{%- endif %}
{%- for m in rest %}
    {%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content.strip() }}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

TOOLS = """{%- if tools %}
<|system|>You may call these functions:
{%- for tool in tools %}
{{ tool | tojson(indent=2) }}
{%- endfor %}
Reply with <call>{"name": ..., "arguments": ...}</call>.<|end|>
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
<|assistant|>
        {%- if message.reasoning_content is defined and message.reasoning_content and loop.last %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{ message.content }}
        {%- if message.tool_calls is defined %}
            {%- for call in message.tool_calls %}
<call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}</call>
            {%- endfor %}
        {%- endif %}
<|end|>
    {%- elif message.role == 'tool' %}
<|tool name="{{ message.name }}"|>{{ message.content }}<|end|>
    {%- else %}
<|{{ message.role }}|>{{ message.content }}<|end|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>{% if enable_thinking %}<think>{% endif %}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search", "description": 'Find "things"', "parameters": {"type": "object", "properties": {}}},
}

CONVERSATION = [
    {"role": "system", "content": "  Be brief.\n"},
    {"role": "user", "content": "Hi there! ¿Qué tal? 你好"},
    {"role": "assistant", "content": "Hello.  "},
    {"role": "user", "content": "Tell me\nsomething."},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Tokyo for 2 days?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Tokyo", "days": 2}}}
        ],
    },
    {"role": "tool", "name": "get_weather", "tool_call_id": "call_1", "content": '{"temp": 21.5, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21.5 °C and clear.", "reasoning_content": "Use the tool result."},
    {"role": "user", "content": "Thanks"},
]

CASES = [
    ("chatml", CHATML, {"messages": CONVERSATION, "add_generation_prompt": True}),
    ("chatml_no_system", CHATML, {"messages": CONVERSATION[1:2], "add_generation_prompt": False}),
    ("headers", HEADERS, {"messages": CONVERSATION, "add_generation_prompt": True, "bos_token": "<|begin|>"}),
    ("headers_no_system", HEADERS, {"messages": CONVERSATION[1:], "add_generation_prompt": False, "bos_token": ""}),
    ("headers_bad_order", HEADERS, {"messages": [CONVERSATION[2], CONVERSATION[1]], "add_generation_prompt": True,
                                    "bos_token": ""}),
    ("tools", TOOLS, {"messages": TOOL_CONVERSATION, "tools": [WEATHER, SEARCH], "add_generation_prompt": True,
                      "enable_thinking": True}),
    ("tools_none", TOOLS, {"messages": CONVERSATION[1:2], "add_generation_prompt": True, "enable_thinking": False}),
]


def main() -> None:
    cases = []
    for name, template, variables in CASES:
        compiled = _compile_jinja_template(template)
        case = {"name": name, "template": template, "variables": variables}
        try:
            case["expected"] = compiled.render(**variables)
        except Exception as e:  # noqa: BLE001 - the error text is the expected output
            case["error"] = str(e)
        cases.append(case)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    doc = {"generator": "scripts/make_chat_fixtures.py", "transformers": transformers.__version__, "cases": cases}
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
