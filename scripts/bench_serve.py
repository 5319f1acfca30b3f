#!/usr/bin/env python3
"""Load test of an OpenAI-compatible server: N clients at once, each streaming chat
completions of a fixed length, as DESIGN.md's llama-server figures were measured.

    scripts/bench_serve.py --url http://127.0.0.1:8080 --clients 1 8 64 --tokens 64 [--rounds 1]
    scripts/bench_serve.py --url sluice=http://127.0.0.1:8080 llama-server=http://127.0.0.1:8081 --rounds 3

Prints, per client count, the aggregate generated tokens per second (all clients'
tokens over the wall time of the round), and time to first token p50 / p99, the
medians over the rounds. Several servers (NAME=URL) take turns round by round, so a
drift of the machine's speed falls on each alike; the last column is each server's
throughput over the first one's. Standard
library only; the server must accept `ignore_eos` (sluice and llama.cpp do) so every
answer has exactly --tokens tokens.
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Describe the water cycle to a child.",
    "What are the rules of chess?",
    "Tell me about the history of paper.",
    "How does a refrigerator work?",
    "Write a poem about autumn leaves.",
    "Why is the sky blue?",
]


def one_request(url, i, tokens, out):
    u = urllib.parse.urlparse(url)
    body = json.dumps({
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
        "max_tokens": tokens,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "ignore_eos": True,
    })
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        out.append({"error": f"{resp.status} {resp.read()[:200]!r}"})
        return
    first = None
    pieces = 0
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        ch = chunk.get("choices") or []
        if ch and ch[0]["delta"].get("content"):
            pieces += 1
            if first is None:
                first = time.perf_counter() - t0
    conn.close()
    out.append({"ttft": first if first is not None else float("nan"), "pieces": pieces, "total": time.perf_counter() - t0})


def round_of(url, clients, tokens):
    out = []
    threads = [threading.Thread(target=one_request, args=(url, i, tokens, out)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [o["error"] for o in out if "error" in o]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")
    ttft = sorted(o["ttft"] for o in out)
    p99 = ttft[min(len(ttft) - 1, int(round(0.99 * (len(ttft) - 1))))]
    return clients * tokens / wall, statistics.median(ttft), p99


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", nargs="+", default=["http://127.0.0.1:8080"], help="URL or NAME=URL, one per server")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    servers = [u.split("=", 1) if "=" in u else [u, u] for u in a.url]
    width = max(len(name) for name, _ in servers)
    print(f"{'server':{width}}  clients  aggregate tok/s  ttft p50 s  ttft p99 s  vs first", flush=True)
    for n in a.clients:
        rows = {name: [] for name, _ in servers}
        for _ in range(a.rounds):
            for name, url in servers:
                rows[name].append(round_of(url, n, a.tokens))
        base = None
        for name, _ in servers:
            r = rows[name]
            agg = statistics.median(x[0] for x in r)
            p50 = statistics.median(x[1] for x in r)
            p99 = statistics.median(x[2] for x in r)
            base = base or agg
            print(f"{name:{width}}  {n:7d}  {agg:15.1f}  {p50:10.2f}  {p99:10.2f}  {agg / base:8.2f}", flush=True)


if __name__ == "__main__":
    main()
