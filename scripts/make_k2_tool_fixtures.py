"""Reference parses of Kimi K2 tool calls by mlx-lm 0.32.2.

Writes mlx-k3/tests/fixtures/chat/k2_tool_calls.json. For each hand-written model output (ordinary calls,
several calls and sections, odd spacing, Python-literal and malformed arguments, truncated sections, unicode)
it records what mlx-lm's server makes of it: the output is split by mlx-lm's own `TextStateMachine` with the
transitions its server builds for a tokenizer whose tool parser is `kimi_k2` (`<|tool_calls_section_begin|>`
opens the tool state, `<|tool_calls_section_end|>` closes it; the whole output is fed at once and the buffer
flushed, as on a length stop), and each tool section's text goes through `tool_parsers/kimi_k2.py`'s
`parse_tool_call` and the server's formatting (`json.dumps(arguments, ensure_ascii=False)`; a section whose
parse raises ValueError or JSONDecodeError is dropped, as `ToolCallFormatter` drops it). Where the server
would fail the request instead (arguments that `json.dumps` cannot write, such as a Python set), the case
records `"reference_error"` and mlx-k3's documented behaviour is checked instead.

It also records `parse_tool_call` on single section texts (`sections`), so the regular expressions are
checked apart from the splitting.

Run: .venv/bin/python scripts/make_k2_tool_fixtures.py  (mlx-lm 0.32.2, as in the project's .venv)
"""

import json
from importlib.metadata import version
from pathlib import Path

from mlx_lm.generate import TextStateMachine
from mlx_lm.tool_parsers import kimi_k2

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "mlx-k3/tests/fixtures/chat/k2_tool_calls.json"
MLX_LM = "0.32.2"

B, E = kimi_k2.tool_call_start, kimi_k2.tool_call_end
CB, CA, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(name, args, idx=0, prefix="functions."):
    return f"{CB}{prefix}{name}:{idx}{CA}{args}{CE}"


def sec(*parts):
    return B + "".join(parts) + E


OUTPUTS = [
    # Ordinary.
    "plain answer, no tools",
    sec(call("get_weather", '{"city": "Paris"}')),
    "Let me check." + sec(call("get_weather", '{"city": "Paris", "days": 3}')),
    "Two at once:" + sec(call("search", '{"q": "umbrella"}', 0), call("search", '{"q": "raincoat"}', 1)),
    sec(call("a", "{}", 0)) + " between " + sec(call("b", "[1, 2]", 1)) + " after",
    # The reply the server test forces (mlx-k3-cli/tests/server_api.rs).
    "Checking." + sec(call("get_weather", "{'city': 'Paris', 'days': 2}", 0), call("get_time", "{}", 1)),
    # Spacing.
    B + "\n" + CB + "\n functions.get_weather:0 \n" + CA + '\n  {"city" :  "Oslo"}  \n' + CE + "\n" + E + "\n",
    sec(CB + "functions.f:12" + CA + '{"x":1.0,"y":1e5,"z":-0,"w":12345678901234567890123,"v":1E-7}' + CE),
    sec(CB + "  \t functions.f:3\t" + CA + '\t{"nested": {"a": [true, false, null, 2.50]}}' + CE),
    # Names and ids.
    sec(CB + "get_time:0" + CA + "{}" + CE),
    sec(CB + "functions.ns.tool:7" + CA + "{}" + CE),
    sec(CB + "functions.a:1:2" + CA + "{}" + CE),
    sec(CB + "functions.:0" + CA + "{}" + CE),
    sec(CB + "functions.weird name-é:99" + CA + "{}" + CE),
    sec(CB + "functions.f:\u0663" + CA + "{}" + CE),
    # Arguments that are not a JSON object.
    sec(call("f", '"just a string"')),
    sec(call("f", "42")),
    sec(call("f", "not json at all")),
    sec(call("f", '{"a": 1} trailing')),
    sec(call("f", "")),
    sec(call("f", '{"a": NaN, "b": Infinity, "c": -Infinity}')),
    sec(call("f", '{"a": 1, "a": 2, "b": 3}')),
    sec(call("f", r'{"s": "tab\tquote\" uni\u00e9 pair\ud83d\ude00 slash\/"}')),
    # Python literals (ast.literal_eval).
    sec(call("f", "{'city': 'Paris', 'ok': True, 'n': None}")),
    sec(call("f", "{'a': (1, 2), 'b': [1.5, -2, +3], 'c': {'d': False},}")),
    sec(call("f", r"""{'esc': 'line\nnext \'q\' \x41\u00e9\U0001F600 \\ \d \101', "dq": "x", 'cat' "enated": r'raw\n'}""")),
    sec(call("f", r"""{'esc': 'bad \x4'}""")),
    sec(call("f", "{'set?': 1, 'tuplekey': {(1, 2): 3}}")),
    sec(call("f", "{'x': 1} # comment")),
    sec(call("f", "{1: 'int key', 2.5: 'float key', True: 'bool key', None: 'none key'}")),
    sec(call("f", "{'big': 123456789012345678901234567890, 'neg': -0, 'hex': 0x1F, 'us': 1_000, 'f': 1e-7}")),
    sec(call("f", "('tuple', 1)")),
    sec(call("f", "'a python string'")),
    sec(call("f", "{'a': 1}  \n")),
    sec(call("f", "{'a': true}")),
    sec(call("f", "{'a': 1")),
    sec(call("f", "{'multi':\n  [1,\n   2]}")),
    sec(call("f", "{'a': 1e3, 'b': .5, 'c': 5., 'd': 0o17, 'e': 0b101, 'g': 0X_ff, 'h': 1_0.2_5e1_0}")),
    sec(call("f", "'''tri\nple''' \"cat\"")),
    sec(call("f", "{'a': 01}")),
    sec(call("f", "[1, 2,]")),
    sec(call("f", "(1,)")),
    sec(call("f", "()")),
    sec(call("f", "(((5)))")),
    sec(call("f", "- 3")),
    sec(call("f", "--3")),
    sec(call("f", "[1,\n# note\n 2]")),
    sec(call("f", "u'uni' R'raw\\q'")),
    sec(call("f", "f'fstr'")),
    sec(call("f", "{'n': 1e400, 'm': -1e400}")),
    sec(call("f", '{"n": 1e400}')),
    sec(call("f", "{'a': None,\n 'b': 'x'}\n\n")),
    sec(call("f", "-True")),
    sec(call("f", "{'a': 1}\r\n")),
    sec(call("f", "'a'\n'b'")),
    sec(call("f", "rb'x'")),
    # Malformed sections.
    sec(CB + 'functions.f:0{"a": 1}' + CE),
    sec(CB + "functions.f" + CA + '{"a": 1}' + CE),
    sec(call("good", "{}", 0), CB + "functions.bad" + CA + "{}" + CE) + " text",
    sec("functions.bare:0" + CA + '{"a": 1}'),
    B + E + "after empty section",
    B + "   " + E,
    "stray end " + E + " and " + CB + "outside" + CE,
    sec(CB + "functions.f:0" + CA + '{"a": 1}' + CE + B),
    sec(call("f", '{"s": "has <|tool_call_end|> inside"}')),
    # Truncated.
    "cut " + B + CB + "functions.f:0" + CA + '{"a": 1}' + CE,
    "cut " + B + CB + "functions.f:0" + CA + '{"a": ',
    "cut " + B + CB + "functions.f:0" + CA + '{"a": 1}',
    "cut " + B + CB + "functions.f",
    "cut <|tool_calls_sec",
    "cut " + B,
    # Unicode.
    "Погода:" + sec(call("погода", '{"город": "Москва", "emoji": "☔🌧"}')) + "готово",
    sec(call("f", '{"cjk": "東京", "rtl": "שלום", "nbsp": "a\u00a0b", "ctl": "\\u0001"}')),
    sec(CB + "\u00a0functions.f:0\u2028" + CA + '\u3000{"a": 1}\u0085' + CE),
    sec(CB + "\x1cfunctions.f:0" + CA + '\x1f{"a": 1}' + CE),
    sec(CB + "\x0bfunctions.f:0\x0c" + CA + '\x0b{"a": 1}' + CE),
    # What the server cannot write.
    sec(call("f", "{'s': {1, 2}}")),
    sec(call("f", "{'c': 1+2j}")),
    sec(call("f", "{'b': b'bytes'}")),
    sec(call("f", "set()")),
    sec(call("f", "[...]")),
]

# Single section texts for parse_tool_call alone.
SECTIONS = [
    "functions.f:0<|tool_call_argument_begin|>{\"a\": 1}",
    "  functions.f:0  <|tool_call_argument_begin|>  {\"a\": 1}  ",
    "f:0<|tool_call_argument_begin|>[1]",
    "no call here",
    "<|tool_call_begin|>functions.x:0<|tool_call_argument_begin|>1<|tool_call_end|>"
    "<|tool_call_begin|>functions.y:1<|tool_call_argument_begin|>{'k': 'v'}<|tool_call_end|>",
]


def server_split(text):
    sm = TextStateMachine({"normal": [(B, "tool")], "tool": [(E, "normal")]})
    st = sm.make_state("normal")
    st, segs = TextStateMachine.split(st, text)
    st, flushed, cur = TextStateMachine.flush(st)
    segs.append((cur, flushed))
    content, tool_text, sections, prev = "", "", [], "normal"
    for state, piece in segs:
        if state == "tool":
            tool_text += piece
        elif state == "normal":
            if prev == "tool":
                sections.append(tool_text)
                tool_text = ""
            content += piece
        prev = state
    if prev == "tool" and tool_text:
        sections.append(tool_text)
    return content, sections


def format_calls(section):
    """ToolCallFormatter for one section: a list of calls, or None where the server drops it."""
    try:
        parsed = kimi_k2.parse_tool_call(section, None)
    except (ValueError, json.JSONDecodeError):
        return None
    if not isinstance(parsed, list):
        parsed = [parsed]
    return [
        {"id": tc["id"], "name": tc["name"], "arguments": json.dumps(tc["arguments"], ensure_ascii=False)}
        for tc in parsed
    ]


def main():
    assert version("mlx-lm") == MLX_LM, f"mlx-lm {version('mlx-lm')} is not the pinned {MLX_LM}"
    outputs = []
    for text in OUTPUTS:
        content, sections = server_split(text)
        case = {"text": text, "content": content, "sections": sections}
        try:
            calls = []
            for s in sections:
                calls.extend(format_calls(s) or [])
            case["tool_calls"] = calls
        except Exception as e:  # the server would fail the request
            case["reference_error"] = f"{type(e).__name__}: {e}"
        outputs.append(case)
    singles = []
    for text in SECTIONS:
        try:
            r = format_calls(text)
        except Exception as e:
            r = f"{type(e).__name__}"
        singles.append({"text": text, "calls": r})
    doc = {
        "reference": f"mlx-lm {MLX_LM} tool_parsers/kimi_k2.py, split by mlx_lm.generate.TextStateMachine",
        "outputs": outputs,
        "sections": singles,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    errs = sum("reference_error" in c for c in outputs)
    print(f"wrote {OUT}: {len(outputs)} outputs ({errs} the server fails), {len(singles)} sections")


if __name__ == "__main__":
    main()
