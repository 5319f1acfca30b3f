#!/usr/bin/env python3
"""Sums a streamed store's trace per layer: where a step's time went and whether the
disk was busy meanwhile.

  SLUICE_STORE_TRACE=1 sluice bench --residency streamed ... 2> trace.txt
  scripts/store_trace.py trace.txt [--step N]

A step is one pass over the layers (step 0: the first prompt chunk). For each layer:
from its fetch to the next layer's, how long its experts took (up to the last one
given back) and how much of that was waiting for reads, then the rest (attention and
the other products of the next layer); the chunks read in each part, their rate, and
the loads in flight on average. Needs only Python 3.
"""
import argparse
import re


def events(path):
    for line in open(path):
        if line.startswith("store-trace "):
            _, t, *rest = line.split()
            yield float(t), rest


def main():
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--step", type=int, default=0)
    a = p.parse_args()
    ev = list(events(a.trace))
    fetches = [(t, int(r[1][1:])) for t, r in ev if r[0] == "fetch"]
    # Steps: a fetch of a layer no later than the previous fetch's starts a new one.
    steps, cur = [], []
    for t, layer in fetches:
        if cur and layer <= cur[-1][1]:
            steps.append(cur)
            cur = []
        cur.append((t, layer))
    steps.append(cur)
    if a.step >= len(steps):
        raise SystemExit(f"the trace has {len(steps)} steps")
    step = steps[a.step]
    end_of_step = steps[a.step + 1][0][0] if a.step + 1 < len(steps) else ev[-1][0]
    print("| layer | ms | experts ms | waiting ms | after ms | chunks in experts (per ms) | chunks after | loads in flight |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, (start, layer) in enumerate(step):
        stop = step[k + 1][0] if k + 1 < len(step) else end_of_step
        w = [(t, r) for t, r in ev if start <= t < stop]
        given = [t for t, r in w if r[0] == "release" and r[1] == f"L{layer}"]
        last = max(given, default=start)
        waiting, pending = 0.0, {}
        inflight, area, prev = set(), 0.0, start
        chunks_in = chunks_after = 0
        for t, r in w:
            area += len(inflight) * (t - prev)
            prev = t
            if r[0] == "take" and r[3] == "wait=true":
                pending[r[2]] = t
            elif r[0] == "took" and r[2] in pending:
                waiting += t - pending.pop(r[2])
            elif r[0] == "chunk":
                inflight.add((r[1], r[2]))
                if t <= last:
                    chunks_in += 1
                else:
                    chunks_after += 1
            elif r[0] == "read":
                inflight.discard((r[1], r[2]))
        span = max(last - start, 1e-9)
        print(f"| {layer} | {stop - start:.0f} | {last - start:.0f} | {waiting:.0f} | {stop - last:.0f} "
              f"| {chunks_in} ({chunks_in / span:.2f}) | {chunks_after} | {area / max(stop - start, 1e-9):.1f} |")


if __name__ == "__main__":
    main()
