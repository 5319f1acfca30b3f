#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the binaries built here
# in devbin/ (see scripts/device-notes.md): the CUDA backend's tests, then speed.
#
#   devbin/gpu-tests   cargo test -p sluice-cuda --no-run's test binary, stripped
#   devbin/sluice      the release CLI, stripped (optional: the speed part)
#   devbin/models/     real models in parts under the carry limit (optional; below)
#
# The working tree takes about 30 MB of a call's 64 MiB, so the binaries travel as one
# archive (tar czf devbin/bins.tgz ..., about 22 MB; unpack with tar xzf first) and a
# real model in parts of at most 33 MB, one call each while the machine stays warm
# (split -b 33000000, renamed NAME.part1, .part2, ...).
set -uo pipefail
export SLUICE_REPO="$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# NVRTC comes with the CUDA toolkit or with the nvidia-cuda-nvrtc Python package.
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)/nvidia/cu13/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
# Real models (scripts/fetch_models.sh) travel in parts of under 64 MiB, one call
# each while the machine stays warm (scripts/device_parts.sh cuts them):
# devbin/models/NAME.part1..9, joined here once into $SLUICE_MODELS for
# real_models_against_the_cpu, and checked against NAME.sha256 where it came along.
names=
for first in devbin/models/*.part1; do
    [ -f "$first" ] || continue
    export SLUICE_MODELS=/tmp/sluice-models
    mkdir -p "$SLUICE_MODELS"
    name=$(basename "$first" .part1)
    [ -f "$SLUICE_MODELS/$name" ] || cat devbin/models/"$name".part? >"$SLUICE_MODELS/$name"
    if [ -f devbin/models/"$name".sha256 ] &&
        ! (cd "$SLUICE_MODELS" && sha256sum --quiet -c "$OLDPWD/devbin/models/$name.sha256"); then
        echo "$name: the joined parts are not the model (a part missing?); left out"
        rm -f "$SLUICE_MODELS/$name"
        continue
    fi
    names="$names,$name"
done
[ -n "$names" ] && export SLUICE_GPU_MODELS="${names#,}"
status=0
# GPU_TESTS: only the tests whose names contain it (and not the integer products'
# second run), e.g. GPU_TESTS=real_models after a model's last part came.
if [ -x devbin/gpu-tests ] && [ -n "${GPU_TESTS:-}" ]; then
    echo "== tests matching $GPU_TESTS"
    devbin/gpu-tests --test-threads 1 --nocapture "$GPU_TESTS" 2>&1 || status=1
elif [ -x devbin/gpu-tests ]; then
    echo "== tests"
    devbin/gpu-tests --test-threads 1 --nocapture 2>&1 || status=1
    echo "== tests of the integer products (SLUICE_CUDA_PRODUCTS=int)"
    SLUICE_CUDA_PRODUCTS=int devbin/gpu-tests --test-threads 1 --nocapture every_format quantized_moe fixtures_against \
        long_sequences vram_tier 2>&1 || status=1
    echo "== tests of the float products for every row (SLUICE_CUDA_PRODUCTS=float)"
    SLUICE_CUDA_PRODUCTS=float devbin/gpu-tests --test-threads 1 --nocapture every_format products_together \
        quantized_moe vram_tier 2>&1 || status=1
fi
if [ -x devbin/sluice ] && [ -n "${GPU_BENCH:-}" ]; then
    echo "== speed"
    bash -c "$GPU_BENCH" || status=1
fi
exit $status
