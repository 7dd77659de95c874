#!/usr/bin/env bash
# On the GPU machine: llama.cpp's llama-bench on the family shapes of `moeferry bench --model`
# (issue 17), with random-weight GGUFs written by benchmarks/gguf_random.py.
#
# For each MODEL:TYPE it writes the GGUF into /tmp, computes the -ncmoe N (the first N layers'
# experts on the CPU) that leaves at most FIT of weights on the GPU (default 11GiB, so that with
# the KV cache and compute buffers the card stays near 12 GiB), runs llama-bench at P=128 T=64
# with every layer on the GPU (-ncmoe 0) and with -ncmoe N, samples the GPU's memory.used every
# 100 ms during each run, writes $OUT/llamacpp-<model>.md and deletes the GGUF.
#
# Needs llama-bench as .carry/llamacpp/run.sh builds it (/tmp/lcbuild/bin; `bash .ci/gpu
# prepare` does that) and llama.cpp's gguf-py (.carry/llamacpp/src/gguf-py, or $GGUF_PY).
# Usage: bash benchmarks/llamacpp_families.sh [threads] [MODEL:TYPE ...]
#   default: qwen3-30b-a3b:Q4_K_M gpt-oss-20b:MXFP4 olmoe-1b-7b:Q4_K_M
set -uo pipefail
cd "$(dirname "$0")/.."
threads=${1:-16}; shift || true
if [ $# -gt 0 ]; then models=("$@"); else models=(qwen3-30b-a3b:Q4_K_M gpt-oss-20b:MXFP4 olmoe-1b-7b:Q4_K_M); fi
OUT=${OUT:-gpu-out}; FIT=${FIT:-11GiB}; mkdir -p "$OUT"
bin=${LLAMA_BENCH:-/tmp/lcbuild/bin/llama-bench}
if [ ! -x "$bin" ]; then
    echo "No llama-bench at $bin; build it first (bash .ci/gpu prepare, or .carry/llamacpp/run.sh)." >&2
    exit 1
fi
gpu_mib() { nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits; }

run_bench() {  # gguf, ncmoe: one llama-bench run and the GPU's peak memory.used during it
    local mem=/tmp/lc-mem.$$ smi status idle peak
    idle=$(gpu_mib)
    nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$mem" &
    smi=$!
    LD_LIBRARY_PATH=$(dirname "$bin") "$bin" -m "$1" -p 128 -n 64 -r 2 -t "$threads" -ngl 99 -ncmoe "$2" -o md \
        2> /tmp/lc-err.$$
    status=$?
    [ "$status" -eq 0 ] || tail -5 /tmp/lc-err.$$
    kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
    echo
    peak=$(sort -n "$mem" | tail -1)
    echo "-ncmoe $2: llama-bench exit $status; GPU memory.used peak ${peak:-?} MiB," \
         "$(( ${peak:-0} - idle )) MiB above the idle GPU's $idle MiB (CUDA context, weights, KV cache, buffers)"
    rm -f "$mem" /tmp/lc-err.$$
}

for spec in "${models[@]}"; do
    model=${spec%%:*}; type=${spec#*:}
    gguf=/tmp/family-$model-$type.gguf md=$OUT/llamacpp-$model.md
    free_gb=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
    if [ "$free_gb" -lt 24 ]; then
        echo "Only ${free_gb} GB free in /tmp, and a GGUF needs up to 18 GB; skipping $model." >&2
        continue
    fi
    start=$(date +%s)
    if ! read -r n left total < <(python3 benchmarks/gguf_random.py --model "$model" --type "$type" --fit "$FIT" "$gguf"); then
        echo "writing $gguf failed" >&2; rm -f "$gguf"; continue
    fi
    {
        echo "# llama.cpp on the $model shape, $type, random weights ($threads threads)"
        echo
        echo "GGUF: $(awk -v b="$total" 'BEGIN {printf "%.2f", b / 2^30}') GiB of tensors, written in" \
             "$(( $(date +%s) - start )) s. -ncmoe $n leaves $(awk -v b="$left" 'BEGIN {printf "%.2f", b / 2^30}')" \
             "GiB of weights on the GPU (at most $FIT asked)."
        echo
        run_bench "$gguf" 0
        if [ "$n" -gt 0 ]; then echo; run_bench "$gguf" "$n"; fi
    } > "$md" 2>&1
    rm -f "$gguf"
    cat "$md"
done
