#!/usr/bin/env bash
# Cuts a model into parts that travel to the GPU machine one call each (a call carries
# at most 64 MiB, the working tree about 30 MB of it): devbin/models/NAME.part1.. of
# 33,000,000 bytes, and NAME.sha256, which scripts/gpu_check.sh checks the joined file
# against (a model some of whose parts did not arrive is then left out, saying so).
#
#   scripts/device_parts.sh .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Carry NAME.sha256 with the first part (the run tool's `carry`), each further part in
# a call of its own while the machine stays warm, then run gpu_check.sh.
set -euo pipefail
model=${1:?usage: scripts/device_parts.sh MODEL}
[ -f "$model" ] || { echo "device_parts: $model is not a file" >&2; exit 1; }
name=$(basename "$model")
out=devbin/models
mkdir -p "$out"
rm -f "$out/$name".part*
split -b 33000000 -d -a 1 "$model" "$out/$name.part"
# split numbers from 0; the parts are named from 1 (gpu_check.sh joins .part1 .. .part9).
n=$(ls "$out/$name".part? | wc -l)
[ "$n" -le 9 ] || { echo "device_parts: $name needs $n parts, gpu_check.sh joins at most 9" >&2; exit 1; }
for i in $(seq $((n - 1)) -1 0); do mv "$out/$name.part$i" "$out/$name.part$((i + 1))"; done
(cd "$(dirname "$model")" && sha256sum "$name") >"$out/$name.sha256"
ls -l "$out/$name".*
