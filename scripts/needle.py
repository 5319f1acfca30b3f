#!/usr/bin/env python3
"""Needle in a haystack: a fact placed at a fraction of a long real-English context,
asked for after it, greedy, at several KV cache widths.

    scripts/needle.py --model M.gguf [--contexts 8192,16384] [--depths 0.1,0.5,0.9]
                      [--kv-bits 16,4,3.5] [--sluice target/release/sluice]

The haystack is the license texts under /usr/share/common-licenses (real files, not
their links), concatenated and repeated as needed, cut to the context's token count
(measured with `sluice tokenize`); the needle goes in at the sentence boundary nearest
the depth. Prints one row per (context, depth, width): retrieved or not, the answer,
and the run's prefill and decode speed. Exit status 1 when any retrieval failed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

NEEDLE = "The secret passphrase for the archive is violet-falcon-42."
QUESTION = "What is the secret passphrase for the archive? Answer with the passphrase only."
ANSWER = "violet-falcon-42"


def haystack_text():
    d = "/usr/share/common-licenses"
    parts = []
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if os.path.isfile(p) and not os.path.islink(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                parts.append(f.read())
    return "\n\n".join(parts)


def count(sluice, model, text):
    """Tokens in `text`, counted in pieces cut at paragraphs (an argument is at most
    128 KiB): within a few tokens of counting it whole."""
    pieces, piece = [], ""
    for para in text.split("\n\n"):
        if piece and len(piece) + len(para) > 60000:
            pieces.append(piece)
            piece = ""
        piece += para + "\n\n"
    pieces.append(piece)
    total = 0
    for p in pieces:
        out = subprocess.run([sluice, "tokenize", "--model", model, "--text", p], capture_output=True, text=True, check=True)
        total += len(json.loads(out.stdout))
    return total


def cut(sluice, model, text, tokens):
    """The longest prefix of `text` (repeated as needed) of at most `tokens` tokens."""
    while count(sluice, model, text) < tokens:
        text = text + "\n\n" + text
    lo, hi = 0, len(text)
    while hi - lo > 64:
        mid = (lo + hi) // 2
        if count(sluice, model, text[:mid]) <= tokens:
            lo = mid
        else:
            hi = mid
    return text[:lo]


def place(text, depth):
    at = int(len(text) * depth)
    dot = text.rfind(". ", 0, at)
    at = dot + 2 if dot > 0 else at
    return text[:at] + NEEDLE + " " + text[at:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--contexts", default="8192,16384")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--kv-bits", default="16,4,3.5")
    ap.add_argument("--sluice", default="target/release/sluice")
    ap.add_argument("--threads", default=None)
    a = ap.parse_args()
    base = haystack_text()
    failed = 0
    print("| context | depth | --kv-bits | retrieved | answer | prefill tok/s | decode tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for ctx in [int(c) for c in a.contexts.split(",")]:
        # Room for the needle, the question and the chat template's tokens.
        text = cut(a.sluice, a.model, base, ctx - 96)
        for depth in [float(x) for x in a.depths.split(",")]:
            prompt = place(text, depth) + "\n\n" + QUESTION
            # From a file: a long context is more than one argument may hold (128 KiB).
            with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
                f.write(prompt)
            for bits in a.kv_bits.split(","):
                cmd = [a.sluice, "run", "--model", a.model, "--chat", "--prompt-file", f.name, "--temperature", "0",
                       "-n", "16", "--kv-bits", bits, "--stats"]
                if a.threads:
                    cmd += ["--threads", a.threads]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    print(r.stderr, file=sys.stderr)
                    sys.exit(f"sluice run failed at context {ctx}, depth {depth}, --kv-bits {bits}")
                answer = r.stdout.strip().replace("\n", " ")
                stats = {}
                for line in r.stderr.splitlines():
                    if line.startswith("{"):
                        stats = json.loads(line)
                ok = ANSWER in answer
                failed += not ok
                print(f"| {ctx} | {depth:.0%} | {bits} | {'yes' if ok else 'NO'} | {answer[:40]} "
                      f"| {stats.get('prefill_tok_s', 0):.1f} | {stats.get('decode_tok_s', 0):.1f} |", flush=True)
            os.unlink(f.name)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
