#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu_check.sh's set-up (devbin/sluice, NVRTC on
# LD_LIBRARY_PATH): makes the Qwen3-30B-A3B geometry with `sluice synth` and times the
# CUDA backend on it, one line per measurement (medians of three runs), for
# scripts/device-notes.md. SPEED_TRACE=1 adds a per-kernel table of 64 decode steps
# and of one prompt (SLUICE_CUDA_TRACE=sync: each launch waited for; cpu: the host's
# time per call). SPEED_PROFILE=1 and SPEED_STALLS=1: Nsight Compute's views of one
# decode step (below).
set -uo pipefail
m=${SPEED_MODEL:-/tmp/q30.gguf}
# SPEED_BIN: another build to time (a baseline), devbin/sluice by default.
bin=${SPEED_BIN:-devbin/sluice}
[ -f "$m" ] || devbin/sluice synth --geometry qwen3-30b-a3b --skew 0.9 --out "$m" >/dev/null || exit 1
# The bench invocation every measurement below shares (all but SPEED_TIER's resident).
base=("$bin" bench -m "$m" --backend cuda --no-roofline)
bench=("${base[@]}" --residency resident)
b() {
    "${bench[@]}" --json "$@" 2>/dev/null | tail -1 |
        python3 -c 'import json, sys; j = json.load(sys.stdin); print("prefill %.1f tok/s, decode %.2f tok/s (%.2f per sequence)" % (j["prefill_tok_s"], j["decode_tok_s"], j["decode_tok_s_per_sequence"]))'
}
# SPEED_SOURCES="NAME:FILE ...": kernel sources timed against each other with this one
# build (`SLUICE_CUDA_SOURCE`, e.g. `git show REV:crates/sluice-cuda/src/kernels.cu`
# saved beside an edited copy); SPEED_BINS="NAME:BINARY ...": builds timed against each
# other, each with its own kernels (a baseline whose host code differs). Both lists may
# be given; their entries are alternated for SPEED_ROUNDS rounds (2), decode and eight
# sequences (SPEED_ONLY=decode or batch: that alone), each compiled once first. Then nothing
# else is timed.
if [ -n "${SPEED_SOURCES:-}${SPEED_BINS:-}" ]; then
    # One entry: NAME, the binary, the kernel source ("" for the binary's own).
    variants=()
    for kv in ${SPEED_SOURCES:-}; do variants+=("${kv%%:*}|$bin|${kv#*:}"); done
    for kv in ${SPEED_BINS:-}; do variants+=("${kv%%:*}|${kv#*:}|"); done
    with() {
        IFS='|' read -r name vbin src <<<"$1"
        bench=("$vbin" "${bench[@]:1}")
        if [ -n "$src" ]; then export SLUICE_CUDA_SOURCE=$src; else unset SLUICE_CUDA_SOURCE; fi
    }
    for v in "${variants[@]}"; do
        with "$v"
        b --prompt-tokens 8 --gen-tokens 2 >/dev/null
    done
    for r in $(seq "${SPEED_ROUNDS:-2}"); do
        for v in "${variants[@]}"; do
            with "$v"
            [ "${SPEED_ONLY:-}" = batch ] || echo "round $r, $name: decode $(b --prompt-tokens 512 --gen-tokens 64)"
            [ "${SPEED_ONLY:-}" = decode ] ||
                echo "round $r, $name: 8 sequences $(b --prompt-tokens 64 --gen-tokens 32 --parallel 8)"
        done
    done
    exit 0
fi
# SPEED_ONLY=decode: the decode line alone (its prompt's rate too), when device time is short.
[ "${SPEED_ONLY:-}" = decode ] || echo "prefill 512:   $(b --prompt-tokens 512 --gen-tokens 1)"
echo "decode:        $(b --prompt-tokens 512 --gen-tokens 64)"
[ "${SPEED_ONLY:-}" = decode ] || echo "8 sequences:   $(b --prompt-tokens 64 --gen-tokens 32 --parallel 8)"
# SPEED_TIER=SIZE: decode with the device taking at most SIZE (`--gpu-memory`), so the
# VRAM tier holds part of the experts and fills the rest from host memory: from the
# page cache (mapped, pageable) and from the store's page-locked copy (resident);
# SPEED_TIER_RESIDENCY and SPEED_TIER_POLICY (`--cache-policy`, lru by default) name
# others, SPEED_TIER_PREFETCH `--prefetch` (off, or pilot: copies a layer ahead; both
# timed when it names both). The tier's traffic (hits, copies) follows each line.
if [ -n "${SPEED_TIER:-}" ]; then
    for r in ${SPEED_TIER_RESIDENCY:-mapped resident}; do
        for p in ${SPEED_TIER_POLICY:-lru}; do
            for f in ${SPEED_TIER_PREFETCH:-off}; do
                echo "tier $SPEED_TIER, $r, $p, prefetch $f: $("${base[@]}" --residency "$r" --cache-policy "$p" --prefetch "$f" --json --gpu-memory "$SPEED_TIER" --prompt-tokens 64 --gen-tokens 64 2>/tmp/tier.err | tail -1 |
                    python3 -c 'import json, sys; j = json.load(sys.stdin); print("decode %.2f tok/s" % j["decode_tok_s"])')"
                grep -h "GPU experts" /tmp/tier.err | tail -1
            done
        done
    done
fi
# SPEED_STREAM="CACHE:GPU_MEMORY ...": decode with the experts streamed from disk
# (`--residency streamed`): host memory holds at most CACHE of them (`--expert-cache`),
# the device GPU_MEMORY in all (`--gpu-memory`, its VRAM tier), the rest read with
# O_DIRECT; beside the disk's roofline (its measured rate over the bytes read a token);
# SPEED_STREAM_PREFETCH the `--prefetch` modes to time (off).
# SPEED_STREAM_MEM=SIZE runs each in a memory cgroup of SIZE where one can be made, so
# that the host's memory is bounded below the expert bytes whatever the page cache does.
if [ -n "${SPEED_STREAM:-}" ]; then
    cg=
    if [ -n "${SPEED_STREAM_MEM:-}" ]; then
        cg=/sys/fs/cgroup/sluice-stream
        if mkdir -p "$cg" 2>/dev/null && echo "$SPEED_STREAM_MEM" >"$cg/memory.max" 2>/dev/null; then
            echo "(each run in a memory cgroup of $SPEED_STREAM_MEM)"
        else
            echo "(no memory cgroup could be made here: host memory not bounded)"
            cg=
        fi
    fi
    limited() {
        if [ -n "$cg" ]; then bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg" "$@"; else "$@"; fi
    }
    for c in $SPEED_STREAM; do
        for f in ${SPEED_STREAM_PREFETCH:-off}; do
            echo "streamed, host cache ${c%%:*}, device ${c#*:}, prefetch $f:"
            limited "$bin" bench -m "$m" --backend cuda --residency streamed --expert-cache "${c%%:*}" \
                --gpu-memory "${c#*:}" --prefetch "$f" --prompt-tokens 64 --gen-tokens 64 --json 2>/tmp/stream.err | tail -1 |
                python3 -c 'import json, sys; j = json.load(sys.stdin); f = lambda k: j.get(k) or 0; print("  decode %.2f tok/s; disk %.0f MB a token, roofline %.2f tok/s (%.0f%% of it); host hit rate %.2f; peak RSS %.2f GiB" % (j["decode_tok_s"], f("decode_disk_bytes_per_token") / 1e6, f("disk_roofline_decode_tok_s"), 100 * f("decode_fraction_of_disk_roofline"), f("decode_hit_rate"), f("peak_rss_bytes") / 2**30))' ||
                tail -3 /tmp/stream.err
            grep -h "GPU experts" /tmp/stream.err | tail -1
        done
    done
fi
if [ -n "${SPEED_TRACE:-}" ]; then
    for mode in sync cpu; do
        for run in "prefill --prompt-tokens 512 --gen-tokens 1" "decode --prompt-tokens 8 --gen-tokens 64"; do
            set -- $run
            echo "== trace $mode, $1"
            shift
            SLUICE_CUDA_TRACE=$mode "${bench[@]}" --repeat 1 "$@" 2>&1 | grep -E 'cuda trace| calls |tok/s' | head -40
        done
    done
fi
if [ -n "${SPEED_PROFILE:-}" ]; then
    # Each kernel's own time and DRAM traffic (Nsight Compute, clocks left alone) over
    # decode steps after a 512-token prompt, summed by kernel over one step
    # (scripts/profile_table.py).
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "== profile ($ncu), one decode step after ${SPEED_PROFILE_PROMPT:-512} tokens"
    "$ncu" --clock-control none --launch-skip "${SPEED_PROFILE_SKIP:-3000}" --launch-count "${SPEED_PROFILE_COUNT:-3000}" \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
        --csv --page raw --print-units base "${bench[@]}" --repeat 1 --prompt-tokens "${SPEED_PROFILE_PROMPT:-512}" \
        --gen-tokens 8 >/tmp/profile.csv 2>/tmp/profile.err ||
        tail -5 /tmp/profile.err
    python3 scripts/profile_table.py /tmp/profile.csv
fi
if [ -n "${SPEED_STALLS:-}" ]; then
    # Why the decode products and attention wait: Nsight Compute's warp states (cycles
    # between a warp's instructions and their reasons, with its rules' reading of them)
    # and occupancy (what limits blocks an SM), for a few decode launches of each
    # kernel SPEED_STALLS_KERNELS matches (the skip counts only matching launches).
    ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "== warp states ($ncu), decode after ${SPEED_PROFILE_PROMPT:-512} tokens"
    "$ncu" --clock-control none -k "regex:${SPEED_STALLS_KERNELS:-^(mmo_q|mmglu_|mmgo_|attention_1)}" \
        --launch-skip "${SPEED_STALLS_SKIP:-400}" --launch-count "${SPEED_STALLS_COUNT:-8}" \
        --section WarpStateStats --section Occupancy "${bench[@]}" --repeat 1 \
        --prompt-tokens "${SPEED_PROFILE_PROMPT:-512}" --gen-tokens 8 2>&1 |
        grep -vE '^(==PROF==|prompt|decode|  *-+ *-+)' | head -"${SPEED_STALLS_LINES:-240}"
fi
