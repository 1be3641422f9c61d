"""mlx-lm's HTTP server, started with the drop-in (``python -m mlx_k3 server``), answers a chat request with
the codebook checkpoint (which mlx-lm alone cannot load, see test_drop_in) and with k3-nano as it ships
(bf16, which mlx-lm alone cannot run on a CPU: its server dropped the connection)."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import mlx_lm
import pytest

import checkpoints
import mlx_k3  # noqa: F401


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=120):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module", params=["codebook", "k3_nano"])
def model_dir(request, codebook_ckpts):
    return {"codebook": codebook_ckpts[0], "k3_nano": checkpoints.K3_NANO}[request.param]


@pytest.fixture(scope="module")
def server(model_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_k3", "server", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2):
                break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                pytest.fail("the server did not start within 120 s")
            time.sleep(0.3)
    yield base
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_chat_completion(server, model_dir):
    messages = [{"role": "user", "content": "def read_config(path):"}]
    reply = post(f"{server}/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0.0})
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] > 0 and choice["message"]["content"].strip()
    # The server's greedy answer is the drop-in's, for the prompt mlx-lm builds from the messages (the
    # checkpoint has no chat template, so the server joins them as text).
    from mlx_lm.server import convert_chat

    model, tok = mlx_lm.load(str(model_dir))
    with mx.stream(mx.cpu):
        want = mlx_lm.generate(model, tok, tok.encode(convert_chat(messages, None)), max_tokens=24)
    assert choice["message"]["content"] == want
