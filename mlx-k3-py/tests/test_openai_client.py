"""The official ``openai`` Python client (PyPI, pinned in requirements-dev.txt) against ``mlx-k3 serve`` with
k3-nano: chat non-streaming and streaming (greedy: the two agree), tools accepted and answered in OpenAI's
shape, completions, models, and the API key. k3-nano never writes a tool call, so parsing Kimi K3's tool-call
syntax into ``tool_calls`` is covered by the Rust test tests/chat.rs (against mlx-lm's parser), not here."""

import subprocess
import threading

import openai
import pytest

from checkpoints import ROOT

NANO = ROOT / "models" / "k3-nano"
KEY = "test-key-123"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def server(rust_cli):
    proc = subprocess.Popen(
        [str(rust_cli), "serve", "--port", "0", "--model", str(NANO), "--api-key", KEY],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    first = []
    reader = threading.Thread(target=lambda: first.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)
    if not first or "http://" not in first[0]:
        proc.kill()
        pytest.fail(f"mlx-k3 serve did not print its address: {first}")
    url = first[0].strip().rsplit(" ", 1)[-1]
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def model_id(client):
    return client.models.list().data[0].id


def test_models_list_names_the_loaded_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["k3-nano"]


def test_chat_streaming_and_non_streaming_agree(client):
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    args = dict(model=model_id(client), messages=messages, max_tokens=16, temperature=0, seed=1)
    full = client.chat.completions.create(**args)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert 0 < full.usage.completion_tokens <= 16 and full.usage.prompt_tokens > 0
    content = choice.message.content or ""
    reasoning = getattr(choice.message, "reasoning_content", None) or ""
    assert content or reasoning, full

    text, thought, finish = "", "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        thought += getattr(delta, "reasoning_content", None) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (text, thought) == (content, reasoning)
    assert finish == choice.finish_reason


def test_tools_are_accepted_and_answers_keep_openais_shape(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model=model_id(client), messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=8, temperature=0)
    full = client.chat.completions.create(**args)
    msg = full.choices[0].message
    assert msg.role == "assistant"
    # Whatever the model wrote, the answer parses with the client's types: tool calls (if any) are typed.
    for call in msg.tool_calls or []:
        assert call.type == "function" and call.function.name
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions(client):
    r = client.completions.create(model=model_id(client), prompt="def main():", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id(client), prompt="def main():", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_a_wrong_key_is_an_authentication_error(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
