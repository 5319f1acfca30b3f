#!/usr/bin/env python3
"""Reproduces the engine's speed figures on this machine, alternating the runs it
compares and quoting medians (the machines these figures come from are shared, and
their speed drifts from minute to minute). Needs only Python 3 and a release build.

  scripts/bench_engine.py ab BASE_BIN NEW_BIN MODEL [--rounds N] [-- BENCH FLAGS]
      the same `sluice bench` with two binaries, alternated: medians and the median
      of per-round ratios NEW/BASE for prefill and decode.
  scripts/bench_engine.py parallel MODEL [--n 8] [--rounds N] [-- BENCH FLAGS]
      `bench --parallel 1` against `--parallel N`, alternated: aggregate decode, the
      ratio, and the memory roofline (bandwidth measured in the same runs over the
      bytes one step reads).
  scripts/bench_engine.py prefill MODEL --cache SIZE [--rounds N] [--tokens 512]
      a streamed prompt against the same prompt with the experts in memory (mapped,
      page cache warm: the computation alone) and the disk time (the bytes it read
      over the O_DIRECT bandwidth bench measures), alternated.
  scripts/bench_engine.py plan MODEL [--rounds N] [--routing HIST] [-- FLAGS]
      `sluice plan --json` against `sluice bench --json` with the same flags,
      alternated: predicted and measured decode and prefill, and their ratio
      (the plan given the routing histogram HIST when there is one).

The binary is target/release/sluice unless --bin says otherwise. Threads: --threads
in the flags (default: what sluice picks).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_json(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(binary, model, flags):
    return run_json([binary, "bench", "-m", model, "--json"] + flags)


def med(xs):
    return statistics.median(xs)


def fmt_ratios(rs):
    return ", ".join(f"{r:.2f}" for r in rs)


def cmd_ab(a):
    rows = {a.base: [], a.new: []}
    for r in range(a.rounds):
        for b in ([a.base, a.new] if r % 2 == 0 else [a.new, a.base]):
            j = bench(b, a.model, a.flags)
            rows[b].append((j["prefill_tok_s"], j["decode_tok_s"]))
    print(f"| phase | base median | new median | new/base (median of rounds) | rounds |")
    print("| --- | --- | --- | --- | --- |")
    for k, name in enumerate(["prefill", "decode"]):
        base = [x[k] for x in rows[a.base]]
        new = [x[k] for x in rows[a.new]]
        ratios = [n / b for b, n in zip(base, new)]
        print(f"| {name} | {med(base):.2f} | {med(new):.2f} | {med(ratios):.3f} | {fmt_ratios(ratios)} |")


def cmd_parallel(a):
    one, many = [], []
    for r in range(a.rounds):
        for n in ([1, a.n] if r % 2 == 0 else [a.n, 1]):
            j = bench(a.bin, a.model, a.flags + ["--parallel", str(n)])
            (one if n == 1 else many).append(j)
    d1 = [j["decode_tok_s"] for j in one]
    dn = [j["decode_tok_s"] for j in many]
    ratios = [y / x for x, y in zip(d1, dn)]
    bw = med([j["memory_read_bytes_per_s"] for j in one + many if j.get("memory_read_bytes_per_s")] or [0])
    per_token = one[0]["weight_bytes_per_token"]
    print(f"model {a.model}: {per_token / 1e6:.1f} MB of weights per token, memory {bw / 1e9:.1f} GB/s")
    print("| sequences | decode tok/s (aggregate) | per sequence | x of one | one-sequence roofline |")
    print("| --- | --- | --- | --- | --- |")
    roof = bw / per_token if per_token else 0
    print(f"| 1 | {med(d1):.2f} | {med(d1):.2f} | 1 | {roof:.1f} |")
    print(f"| {a.n} | {med(dn):.2f} | {med([j['decode_tok_s_per_sequence'] for j in many]):.2f} | "
          f"{med(ratios):.2f} ({fmt_ratios(ratios)}) | |")
    reqs = [j["experts"]["store"]["requests"] for j in many]
    if reqs and reqs[0]:
        print(f"(expert requests, last round: one sequence {one[-1]['experts']['store']['requests']}, "
              f"{a.n} sequences {many[-1]['experts']['store']['requests']})")


def cmd_prefill(a):
    flags = ["--prompt-tokens", str(a.tokens), "--gen-tokens", "1", "--repeat", "1"] + a.flags
    streamed, mapped = [], []
    for r in range(a.rounds):
        for mode in (["streamed", "mapped"] if r % 2 == 0 else ["mapped", "streamed"]):
            extra = ["--residency", "streamed", "--expert-cache", a.cache] if mode == "streamed" else \
                ["--residency", "mapped", "--no-roofline"]
            j = bench(a.bin, a.model, flags + extra)
            (streamed if mode == "streamed" else mapped).append(j)
    t = lambda j: a.tokens / j["prefill_tok_s"]
    ts, tm = [t(j) for j in streamed], [t(j) for j in mapped]
    read = med([j["experts"]["store"]["bytes_read"] for j in streamed])
    bw = med([j["disk"]["bytes_per_s"] for j in streamed if j.get("disk")])
    wait = med([j["phases_last_run"]["expert_wait_ms"] / 1e3 for j in streamed])
    disk = read / bw
    bound = max(disk, med(tm))
    print(f"| prompt | streamed ({a.cache} cache) | experts in memory (compute) | disk: {read / 1e9:.1f} GB at {bw / 1e9:.2f} GB/s "
          f"| streamed / max(disk, compute) | expert wait |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {a.tokens} tokens | {med(ts):.1f} s | {med(tm):.1f} s | {disk:.1f} s | {med(ts) / bound:.2f} | {wait:.1f} s |")
    print(f"(rounds: streamed {', '.join(f'{x:.1f}' for x in ts)}; in memory {', '.join(f'{x:.1f}' for x in tm)})")


def cmd_plan(a):
    pred, meas = [], []
    for r in range(a.rounds):
        for what in (["plan", "bench"] if r % 2 == 0 else ["bench", "plan"]):
            if what == "plan":
                routing = ["--routing", a.routing] if a.routing else []
                pred.append(run_json([a.bin, "plan", "-m", a.model, "--json"] + a.flags + routing)["prediction"])
            else:
                meas.append(bench(a.bin, a.model, a.flags + ["--no-roofline"]))
    pd, md = med([p["decode_tok_s"] for p in pred]), med([m["decode_tok_s"] for m in meas])
    pp, mp = med([p["prefill_tok_s"] for p in pred]), med([m["prefill_tok_s"] for m in meas])
    flags = " ".join(a.flags + (["--routing", os.path.basename(a.routing)] if a.routing else []))
    print("| model and flags | predicted decode | measured | ratio | predicted prefill | measured | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {os.path.basename(a.model)} {flags} | {pd:.2f} | {md:.2f} | {pd / md:.2f} | {pp:.1f} | {mp:.1f} | {pp / mp:.2f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(ROOT, "target/release/sluice"))
    sub = p.add_subparsers(dest="cmd", required=True)
    ab = sub.add_parser("ab")
    ab.add_argument("base")
    ab.add_argument("new")
    ab.add_argument("model")
    par = sub.add_parser("parallel")
    par.add_argument("model")
    par.add_argument("--n", type=int, default=8)
    pre = sub.add_parser("prefill")
    pre.add_argument("model")
    pre.add_argument("--cache", required=True)
    pre.add_argument("--tokens", type=int, default=512)
    pl = sub.add_parser("plan")
    pl.add_argument("model")
    pl.add_argument("--routing", help="a histogram from --record-routing, for the plan only")
    for s in (ab, par, pre, pl):
        s.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    a = p.parse_args(argv)
    a.flags = flags
    {"ab": cmd_ab, "parallel": cmd_parallel, "prefill": cmd_prefill, "plan": cmd_plan}[a.cmd](a)


if __name__ == "__main__":
    main()
