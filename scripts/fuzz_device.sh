#!/usr/bin/env bash
# Fuzzes on a machine with many cores and no Rust (the GPU machine's 16 cores), from the
# repository root, with one instrumented binary built here:
#
#   (cd fuzz && cargo +nightly fuzz build -O any)
#   mkdir -p devbin/fuzz && cp fuzz/target/x86_64-unknown-linux-gnu/release/any devbin/fuzz/
#   strip devbin/fuzz/any && xz -f devbin/fuzz/any            # ~16 MB instead of 190
#   (cd fuzz && tar cJf ../devbin/fuzz/corpus.tar.xz corpus/T ...)   # optional: go on from a corpus
#
# then there:  FUZZ_PLAN="gguf:5 tokenizer_json:5 server_request:6" FUZZ_SECONDS=520 \
#              OUT=/some/folder bash scripts/fuzz_device.sh
#
# Each TARGET:N of the plan runs N libFuzzer processes (-jobs=N -workers=N) sharing one
# corpus for FUZZ_SECONDS, with the limits of scripts/fuzz.sh. Prints one row per target
# (executions, CPU-seconds, the best coverage a process reached, corpus size, findings)
# and leaves in $OUT the grown corpora (corpus.tar.xz), any findings (artifacts.tar.xz)
# and the table (summary.txt).
set -uo pipefail
root="$PWD"
plan="${FUZZ_PLAN:?FUZZ_PLAN=\"target:processes ...\"}"
seconds="${FUZZ_SECONDS:-520}"
out="${OUT:?OUT names the folder for results}"
work=/tmp/sluice-fuzz
rm -rf "$work" && mkdir -p "$work"
xz -dc devbin/fuzz/any.xz >"$work/any" && chmod +x "$work/any" || exit 1
[ -f devbin/fuzz/corpus.tar.xz ] && tar xJf devbin/fuzz/corpus.tar.xz -C "$work"
export SLUICE_FUZZ_FIXTURES="$root/fixtures/tiny"
# One thread per process: the processes fill the cores already, and a rayon pool of
# every core in each of them made server_request run at 5 executions a second.
export RAYON_NUM_THREADS=1
echo "$(nproc) cores; plan: $plan for ${seconds}s"
for item in $plan; do
    t="${item%%:*}" n="${item##*:}"
    mkdir -p "$work/corpus/$t" "$work/artifacts/$t" "$work/logs/$t"
    (cd "$work/logs/$t" && SLUICE_FUZZ_TARGET="$t" "$work/any" "$work/corpus/$t" "$root/fuzz/seeds/$t" \
        -jobs="$n" -workers="$n" -max_len=65536 -rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 \
        -max_total_time="$seconds" -artifact_prefix="$work/artifacts/$t/" -print_final_stats=1 \
        >main.log 2>&1) &
done
wait
{
    echo "| target | processes | executions | CPU-seconds | exec/s | coverage (edges / features, best process) | corpus | findings |"
    echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
    for item in $plan; do
        t="${item%%:*}" n="${item##*:}"
        logs=("$work/logs/$t"/fuzz-*.log)
        execs=$(cat "${logs[@]}" | sed -n 's/^stat::number_of_executed_units: //p' | awk '{s+=$1} END {print s+0}')
        secs=$(cat "${logs[@]}" | sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' | awk '{s+=$1} END {print s+0}')
        cov=$(for l in "${logs[@]}"; do grep -aE '^#[0-9]+' "$l" | tail -1; done |
            sed -n 's/.* cov: \([0-9]*\) ft: \([0-9]*\).*/\1 \2/p' | sort -n | tail -1 | tr ' ' /)
        corpus=$(ls "$work/corpus/$t" | wc -l)
        found=$(ls "$work/artifacts/$t" | wc -l)
        rate=$(awk -v e="$execs" -v s="$secs" 'BEGIN {printf "%.0f", (s > 0 ? e / s : 0)}')
        echo "| $t | $n | $execs | $secs | $rate | $cov | $corpus | $found |"
    done
} | tee "$out/summary.txt"
for item in $plan; do
    t="${item%%:*}"
    grep -ahE "==ERROR|^SUMMARY|panicked at|deadly signal|out-of-memory \\(|ALARM: working on the last Unit" "$work/logs/$t"/*.log | sort | uniq -c | head -20
done
(cd "$work" && tar cJf "$out/corpus.tar.xz" corpus && tar cJf "$out/artifacts.tar.xz" artifacts)
ls -la "$out"
