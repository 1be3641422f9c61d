"""Reference splits of Kimi K2-Thinking / K2.5 replies into reasoning, answer and tool calls by mlx-lm 0.32.2.

Writes mlx-k3/tests/fixtures/chat/k2_reasoning.json. mlx-lm separates reasoning when the tokenizer's vocabulary
holds both `<think>` and `</think>` (`tokenizer_utils._infer_thinking`), as Kimi K2's does. Its server then
builds a `TextStateMachine` (`generate.make_text_state_machine`) with the transitions normal --`<think>`-->
reasoning --`</think>`--> normal, and for the `kimi_k2` tool parser normal and reasoning --
`<|tool_calls_section_begin|>`--> tool --`<|tool_calls_section_end|>`--> normal; the initial state is
"reasoning" when the prompt's last `<think>` comes after its last `</think>`, else "normal". Text of the
reasoning state goes to `reasoning`, of the normal state to `content`, and each tool section through
`tool_parsers/kimi_k2.py`'s `parse_tool_call` and the server's formatting (`json.dumps(arguments,
ensure_ascii=False)`, unparsable sections dropped) to `tool_calls`.

For each hand-written reply and each initial state this records the split of the whole reply (fed at once,
the buffer flushed at the end as on a length stop; `whole`) and the split of the reply fed in pieces of 1, 2,
3, 5 and 7 characters (`streamed`: the concatenated deltas of every piece size, which this script checks are
all equal), with the same flush.

Run: .venv/bin/python scripts/make_k2_reasoning_fixtures.py  (mlx-lm 0.32.2, as in the project's .venv)
"""

import json
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.tool_parsers import kimi_k2

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "mlx-k3/tests/fixtures/chat/k2_reasoning.json"
MLX_LM = "0.32.2"

B, E = kimi_k2.tool_call_start, kimi_k2.tool_call_end
CB, CA, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
PIECES = (1, 2, 3, 5, 7)


def sec(name, args, idx=0):
    return f"{B}{CB}functions.{name}:{idx}{CA}{args}{CE}{E}"


REPLIES = [
    "<think>Add 2 and 3.</think>The answer is 5.",
    "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
    "Add 2 and 3.</think>The answer is 5.",
    "no reasoning markers at all",
    "<think></think>Just the answer.",
    "<think>unfinished reasoning that hits the length lim",
    "first</think>middle<think>second</think>last",
    "a < b and c </thin k> d <think",
    "<think>I need the weather.</think>Let me check." + sec("get_weather", '{"city": "Paris"}'),
    "<think>Calling from inside the reasoning" + sec("get_time", "{}") + "after the call</think>done",
    "<think>two calls</think>" + sec("a", '{"x": 1}', 0) + " between " + sec("b", "[1, 2]", 1) + " end",
    "<think>ünïcödé 思考</think>答案 ✓",
]


def machine():
    tok = SimpleNamespace(
        has_thinking=True,
        think_start="<think>",
        think_end="</think>",
        has_tool_calling=True,
        tool_call_start=B,
        tool_call_end=E,
        response_transitions={},
        structural_markers=None,
    )
    return make_text_state_machine(tok)


def format_calls(sections):
    out = []
    for text in sections:
        try:
            parsed = kimi_k2.parse_tool_call(text, None)
        except (ValueError, json.JSONDecodeError):
            continue
        for tc in parsed if isinstance(parsed, list) else [parsed]:
            out.append(
                {"id": tc["id"], "name": tc["name"], "arguments": json.dumps(tc["arguments"], ensure_ascii=False)}
            )
    return out


def split(sm, reply, initial, size):
    """What mlx-lm's server collects for ``reply`` fed in pieces of ``size`` characters (0: at once)."""
    state = sm.make_state(initial)
    pieces = [reply] if size == 0 else [reply[i : i + size] for i in range(0, len(reply), size)]
    reasoning = content = tool = ""
    sections = []
    prev = initial
    for i, piece in enumerate(pieces):
        state, segments = TextStateMachine.split(state, piece)
        if i == len(pieces) - 1:
            state, flushed, current = TextStateMachine.flush(state)
            segments.append((current, flushed))
        for name, text in segments:
            if name == "reasoning":
                reasoning += text
            elif name == "tool":
                tool += text
            elif name == "normal":
                if prev == "tool":
                    sections.append(tool)
                    tool = ""
                content += text
            prev = name
    if prev == "tool" and tool:
        sections.append(tool)
    return {"reasoning": reasoning, "content": content, "tool_calls": format_calls(sections)}


def main():
    assert version("mlx-lm") == MLX_LM, f"mlx-lm {MLX_LM} is the reference, found {version('mlx-lm')}"
    sm = machine()
    cases = []
    for reply in REPLIES:
        for initial in ("normal", "reasoning"):
            whole = split(sm, reply, initial, 0)
            streamed = [split(sm, reply, initial, n) for n in PIECES]
            assert all(s == streamed[0] for s in streamed), (reply, initial, streamed)
            cases.append({"reply": reply, "initial": initial, "whole": whole, "streamed": streamed[0]})
    doc = {
        "generator": "scripts/make_k2_reasoning_fixtures.py",
        "mlx_lm": MLX_LM,
        "piece_sizes": list(PIECES),
        "cases": cases,
    }
    OUT.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
