"""Sums an Nsight Compute raw CSV (gpu_speed.sh's SPEED_PROFILE) by kernel over one
decode step: the launches after the first lm head (the product with the largest grid) up
to and including the next one. Prints count, total and mean time, DRAM bytes and the
rate they moved at, and where the CSV has them the registers a thread and the warps
active (mean % of the most an SM holds), largest total first."""
import csv
import sys
from collections import defaultdict

lines = open(sys.argv[1]).read().splitlines()
# Nsight Compute may print notes before the header.
start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), len(lines))
rows = list(csv.DictReader(lines[start:]))
rows = [r for r in rows if r.get("Kernel Name") and r.get("gpu__time_duration.sum", "").replace(".", "").replace(",", "").isdigit()]


def num(r, k):
    return float(r[k].replace(",", ""))


# The lm head: the product with the largest grid (mm_, or mmo_ for one row).
big = max((num(r, "launch__grid_size") for r in rows), default=0)
heads = [i for i, r in enumerate(rows) if num(r, "launch__grid_size") >= 0.9 * big and r["Kernel Name"].startswith(("mm_", "mmo_"))]
if len(heads) < 2:
    print(f"{len(rows)} kernels profiled, fewer than two lm heads among them: widen SPEED_PROFILE_COUNT")
    sys.exit(0)
step = rows[heads[0] + 1 : heads[1] + 1]
REGS, WARPS = "launch__registers_per_thread", "sm__warps_active.avg.pct_of_peak_sustained_active"
occupancy = all(r.get(REGS) and r.get(WARPS) for r in step)
by = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
for r in step:
    b = by[r["Kernel Name"].split("(")[0]]
    b[0] += 1
    b[1] += num(r, "gpu__time_duration.sum")  # ns
    b[2] += num(r, "dram__bytes_read.sum") + num(r, "dram__bytes_write.sum")
    if occupancy:
        b[3] = max(b[3], num(r, REGS))
        b[4] += num(r, WARPS)
total = sum(b[1] for b in by.values())
print(f"one step: {len(step)} kernels, {total / 1e3:.0f} us of kernel time, {sum(b[2] for b in by.values()) / 1e9:.3f} GB")
extra = f"{'regs':>6}{'warps %':>9}" if occupancy else ""
print(f"{'kernel':<22}{'calls':>6}{'total us':>10}{'mean us':>9}{'MB':>9}{'GB/s':>8}{extra}")
for name, (n, t, b, regs, warps) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    extra = f"{regs:>6.0f}{warps / n:>9.1f}" if occupancy else ""
    print(f"{name:<22}{n:>6}{t / 1e3:>10.1f}{t / n / 1e3:>9.2f}{b / 1e6:>9.2f}{b / t:>8.0f}{extra}")
