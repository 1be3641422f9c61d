"""Byte-level BPE in Kimi's tiktoken format: a small deterministic trainer, the file format, and an
independent pure-Python encoder used to cross-check tiktoken.

Training (`train`): pre-tokenize with Kimi's pattern (Python `regex`, V1 mode for the `&&` class
intersections), count chunks, start from the 256 single bytes (ranks 0..255 = byte value), then repeatedly
merge the most frequent adjacent pair (ties: the pair with the smaller (left rank, right rank)). A merge whose
bytes already exist as a token is skipped (tiktoken needs unique token bytes). Rank = creation order.

File (`write_tiktoken` / `load_tiktoken`): one line per token, `base64(token_bytes) rank`, ranks 0..N-1 in
order, exactly what `tiktoken.load.load_tiktoken_bpe` reads.

Encoding (`encode_reference`): what tiktoken's CoreBPE does, in Python: split with the pattern; a piece that
is itself a token becomes that token; otherwise start from bytes and repeatedly merge the adjacent pair whose
concatenation has the lowest rank.
"""

from __future__ import annotations

import base64
import heapq
from collections import Counter
from pathlib import Path

import regex


def compile_pattern(pat_str: str):
    return regex.compile(pat_str, flags=regex.V1)


def chunk_counts(texts, pat) -> Counter:
    c: Counter = Counter()
    for t in texts:
        c.update(pat.findall(t))
    return c


def train(counts: Counter, num_tokens: int, log=print) -> list[bytes]:
    """Token bytes in rank order (len == num_tokens)."""
    vocab = [bytes([i]) for i in range(256)]
    known = set(vocab)
    # Deterministic word order: sorted by the chunk's UTF-8 bytes.
    items = sorted((s.encode("utf-8"), n) for s, n in counts.items())
    words = [list(b) for b, _ in items]
    freqs = [n for _, n in items]

    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for wi, w in enumerate(words):
        f = freqs[wi]
        for p in zip(w, w[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + f
            where.setdefault(p, set()).add(wi)
    heap = [(-c, a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)
    banned = set()

    while len(vocab) < num_tokens and heap:
        negc, a, b = heapq.heappop(heap)
        if (a, b) in banned or pair_counts.get((a, b), 0) != -negc or -negc <= 0:
            continue
        new_bytes = vocab[a] + vocab[b]
        if new_bytes in known:
            banned.add((a, b))
            continue
        new = len(vocab)
        vocab.append(new_bytes)
        known.add(new_bytes)
        changed = set()
        for wi in sorted(where.pop((a, b), ())):
            w = words[wi]
            f = freqs[wi]
            # is the pair still present (where is a superset)?
            if not any(x == a and y == b for x, y in zip(w, w[1:])):
                continue
            for p in zip(w, w[1:]):
                pair_counts[p] -= f
                changed.add(p)
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for p in zip(out, out[1:]):
                pair_counts[p] = pair_counts.get(p, 0) + f
                where.setdefault(p, set()).add(wi)
                changed.add(p)
        pair_counts.pop((a, b), None)
        changed.discard((a, b))
        for p in changed:
            c = pair_counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p[0], p[1]))
        if log and (len(vocab) % 256 == 0):
            log(f"  bpe: {len(vocab)} tokens (last merge count {-negc}: {new_bytes!r})")
    if len(vocab) < num_tokens:
        raise RuntimeError(f"ran out of pairs at {len(vocab)} tokens")
    return vocab


def write_tiktoken(vocab: list[bytes], path: Path) -> None:
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for rank, tok in enumerate(vocab):
            f.write(f"{base64.b64encode(tok).decode('ascii')} {rank}\n")


def load_tiktoken(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path).read_text(encoding="ascii").splitlines():
        if not line:
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    return ranks


def _encode_piece(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    r = ranks.get(piece)
    if r is not None:
        return [r]
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best_rank, best_i = r, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return [ranks[p] for p in parts]


def encode_reference(text: str, ranks: dict[bytes, int], pat) -> list[int]:
    out: list[int] = []
    cache: dict[str, list[int]] = {}
    for piece in pat.findall(text):
        ids = cache.get(piece)
        if ids is None:
            ids = cache[piece] = _encode_piece(piece.encode("utf-8"), ranks)
        out.extend(ids)
    return out
