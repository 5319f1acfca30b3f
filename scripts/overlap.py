#!/usr/bin/env python3
"""Reads an Nsight Systems export (sqlite) of a run and prints how much of the time
its host-to-device copies ran beside kernels, per stream, and how long the GPU did
neither: whether copies on the copy stream overlap the compute stream's kernels.

    nsys profile -o /tmp/run --export sqlite <command>; python3 scripts/overlap.py /tmp/run.sqlite
"""
import sqlite3
import sys


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(iv):
    return sum(e - s for s, e in iv)


def intersect(a, b):
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append([s, e])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


db = sqlite3.connect(sys.argv[1])
kernels = union(db.execute("SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchall())
span = (kernels[0][0], kernels[-1][1]) if kernels else (0, 0)
print(f"span {(span[1] - span[0]) / 1e6:.1f} ms, kernels busy {length(kernels) / 1e6:.1f} ms")
copies = db.execute("SELECT streamId, start, end, bytes FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE copyKind = 1").fetchall()
streams = sorted({c[0] for c in copies})
every = []
for st in streams:
    iv = union([(s, e) for (k, s, e, _) in copies if k == st])
    every += iv
    n = sum(1 for c in copies if c[0] == st)
    gb = sum(c[3] for c in copies if c[0] == st) / 1e9
    busy = length(iv)
    beside = length(intersect(iv, kernels))
    print(f"stream {st}: {n} host-to-device copies, {gb:.2f} GB in {busy / 1e6:.1f} ms "
          f"({gb * 1e9 / max(busy, 1):.1f} GB/s), {100 * beside / max(busy, 1):.0f}% beside kernels")
busy = union(kernels + [list(x) for x in every])
print(f"neither kernels nor copies: {(span[1] - span[0] - length(intersect(busy, [list(span)]))) / 1e6:.1f} ms")
