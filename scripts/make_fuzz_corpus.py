#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (fuzz/corpus/<target>/) from k3-nano and the test fixtures.

Every seed is derived from files already in the repository (no reference library is involved: seeds only
steer the fuzzer, they are not expected values). Run from anywhere; it replaces fuzz/corpus/ wholesale:

    python3 scripts/make_fuzz_corpus.py

Seeds are small (the whole corpus is a few hundred KB): safetensors files are rebuilt from a few of
k3-nano's smallest tensors, the GGUF seeds are the IQ1_S test fixture and small files written here.
"""

import hashlib
import json
import shutil
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "corpus"
NANO = ROOT / "models" / "k3-nano"
FIXTURES = ROOT / "mlx-k3" / "tests" / "fixtures"


def write(target, data, name=None):
    if isinstance(data, str):
        data = data.encode()
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    name = name or hashlib.sha1(data).hexdigest()[:16]
    (d / name).write_bytes(data)


def configs():
    seen = set()
    for p in [NANO / "config.json", *sorted(FIXTURES.glob("k3/*/config.json"))]:
        text = p.read_text()
        if text not in seen:
            seen.add(text)
            write("config", text, f"{p.parent.name}.json")
    nano = json.loads((NANO / "config.json").read_text())
    # The same config nested under text_config (the multimodal layout), and with a quantization entry.
    write("config", json.dumps({"model_type": "kimi_k3", "text_config": nano}), "nested.json")
    q = dict(nano, quantization={"group_size": 64, "bits": 4, "mode": "affine",
                                 "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                                 "model.layers.1.mlp.switch_mlp": {"mode": "k3_codebook"},
                                 "model.layers.2.mlp.switch_mlp": {"mode": "k3_tiered", "affine": None},
                                 "lm_head": False})
    write("config", json.dumps(q), "quantized.json")
    c = dict(nano, quantization_config={"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"})
    write("config", json.dumps(c), "compressed.json")


def safetensors_file(tensors, metadata=None):
    """tensors: [(name, dtype, shape, bytes)] -> a safetensors file."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors():
    with open(NANO / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        small = sorted((v["data_offsets"][1] - v["data_offsets"][0], k) for k, v in header.items()
                       if k != "__metadata__")
        picked = []
        for size, name in small[:6]:
            v = header[name]
            f.seek(base + v["data_offsets"][0])
            picked.append((name, v["dtype"], v["shape"], f.read(size)))
    write("safetensors_header", safetensors_file(picked, header.get("__metadata__")), "nano_small.safetensors")
    write("safetensors_header", safetensors_file(picked[:1]), "nano_one.safetensors")
    write("safetensors_header", safetensors_file([]), "empty.safetensors")
    kinds = [("BOOL", 1), ("U8", 1), ("I8", 1), ("F8_E4M3", 1), ("I16", 2), ("U16", 2), ("F16", 2), ("BF16", 2),
             ("I32", 4), ("U32", 4), ("F32", 4), ("I64", 8), ("U64", 8), ("F64", 8), ("C64", 8)]
    write("safetensors_header",
          safetensors_file([(f"t.{d}", d, [2, 1], bytes(range(2 * s))) for d, s in kinds] + [("z", "F32", [0, 3], b"")],
                           {"format": "pt"}), "dtypes.safetensors")


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_file(kv, tensors, data, version=3):
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, ty, payload in kv:
        out += gguf_string(key) + struct.pack("<I", ty) + payload
    for name, dims, ggml_type, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ggml_type, offset)
    align = 32
    for key, ty, payload in kv:
        if key == "general.alignment":
            align = struct.unpack("<I", payload)[0]
    out += b"\0" * (-len(out) % align)
    return out + data


def gguf():
    shutil.copy(FIXTURES / "codebook" / "tiny_iq1s.gguf", OUT / "gguf" / "tiny_iq1s.gguf")
    # Every metadata type once, an alignment, and two F32 tensors.
    kv = [
        ("general.architecture", 8, gguf_string("kimi_k3")),
        ("general.alignment", 4, struct.pack("<I", 64)),
        ("u8", 0, b"\x07"), ("i8", 1, b"\xf9"), ("u16", 2, struct.pack("<H", 7)), ("i16", 3, struct.pack("<h", -7)),
        ("i32", 5, struct.pack("<i", -7)), ("f32", 6, struct.pack("<f", 0.5)), ("bool", 7, b"\x01"),
        ("u64", 10, struct.pack("<Q", 7)), ("i64", 11, struct.pack("<q", -7)), ("f64", 12, struct.pack("<d", 0.25)),
        ("arr", 9, struct.pack("<IQ", 4, 3) + struct.pack("<3I", 1, 2, 3)),
        ("strs", 9, struct.pack("<IQ", 8, 2) + gguf_string("a") + gguf_string("bc")),
        ("nested", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 2) + b"\x01\x02"),
    ]
    data = struct.pack("<4f", 1.0, -2.0, 3.5, 0.25) + struct.pack("<2f", 7.0, 8.0)
    write("gguf", gguf_file(kv, [("w", [4], 0, 0), ("v", [2, 1], 0, 16)], data), "f32_types.gguf")
    write("gguf", gguf_file([], [("w", [2], 0, 0)], struct.pack("<2f", 1.0, 2.0), version=2), "v2.gguf")


def tokenizer_chat():
    samples = (NANO / "samples.txt").read_text().splitlines()
    texts = [s for s in samples if s.strip()][:6] + ["", "héllo wörld 東京 🙂\n\t  x", "<|im_end|>[EOS]<|open|>a"]
    for i, t in enumerate(texts):
        write("tokenizer_chat", b"\x00" + t[:2000].encode(), f"text_{i}")
    write("tokenizer_chat", b"\x01" + "Be brief.\x1fWhat is 2 + 2?\x1f4\x1fAnd <|im_end|><|close|>?".encode(),
          "conversation")
    k3 = json.loads((FIXTURES / "chat" / "k3_encoding.json").read_text())
    for case in k3["cases"]:
        v = {"messages": case["messages"]}
        if "tools" in case:
            v["tools"] = case["tools"]
        write("tokenizer_chat", b"\x02" + json.dumps(v, ensure_ascii=False).encode(), f"k3_{case['name']}")
    for i, p in enumerate(k3["tool_parses"]):
        write("tokenizer_chat", b"\x04" + p["text"].encode(), f"reply_{i}")
    write("tokenizer_chat", b"\x04" + "<|open|>think<|sep|>hmm<|close|>think<|sep|>The answer is 4.".encode(),
          "reply_think")
    templates = json.loads((FIXTURES / "chat" / "templates.json").read_text())
    for case in templates["cases"]:
        write("tokenizer_chat", b"\x03" + case["template"].encode() + b"\0hi <|im_end|> there", f"tpl_{case['name']}")


def http_request():
    chat = [
        {"messages": [{"role": "user", "content": "Hello"}]},
        {"model": "k3-nano", "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                                          {"role": "user", "content": "Hi"}],
         "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1,
         "stop": ["\n\n", "END"], "presence_penalty": 0.5, "repetition_penalty": 1.1, "logit_bias": {"42": -100},
         "stream": True, "stream_options": {"include_usage": True}, "session": "s-1", "thinking_effort": "low"},
        {"messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "c1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}],
         "tool_choice": "auto", "reasoning_effort": "medium", "n": 1, "logprobs": False},
        {"messages": [{"role": "user", "content": "JSON please"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0, "unknown": 1},
    ]
    for i, c in enumerate(chat):
        write("http_request", b"\x00" + json.dumps(c).encode(), f"chat_{i}")
    completions = [
        {"prompt": "Once upon a time", "max_tokens": 16},
        {"prompt": [1, 2, 3], "stop": "x", "echo": False, "best_of": 1, "suffix": None, "logprobs": None},
        {"prompt": [[5, 6]], "stream": True, "temperature": 0, "session": "abc", "user": "u"},
    ]
    for i, c in enumerate(completions):
        write("http_request", b"\x01" + json.dumps(c).encode(), f"completion_{i}")
    web = {"messages": [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}],
           "session": "s-0123", "max_tokens": 32, "temperature": 0.5, "top_p": 1, "seed": 3, "thinking_effort": "off"}
    write("http_request", b"\x02" + json.dumps(web).encode(), "web_chat")
    write("http_request", b"\x03" + json.dumps({"session": "s-0123"}).encode(), "stop")
    write("http_request", b"\x00{\"messages\": [", "truncated")


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    for t in ["config", "safetensors_header", "gguf", "tokenizer_chat", "http_request"]:
        (OUT / t).mkdir(parents=True)
    configs()
    safetensors()
    gguf()
    tokenizer_chat()
    http_request()
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    for d in sorted(OUT.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds")
    print(f"{total} bytes in all")


if __name__ == "__main__":
    main()
