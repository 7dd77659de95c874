#!/bin/bash
# The CPU engine (no GPU) beside llama.cpp on one machine: bash docs/bench/2026-12-04-cpu/run.sh
# Needs llama-bench built for the CPU (README.md here says how) at $LLAMA_BENCH. GPT_OSS=0 leaves
# out gpt-oss-20b (the last shape). DEPTHS="16,400": tokens already in the context when the 16
# are decoded (llama-bench -d; our --prompt-len), default 16; DENSE=low-bit leaves out our
# float32 variant.
set -u
cd "$(dirname "$0")/../../.."
bin=${LLAMA_BENCH:-/tmp/lccpu2/bin/llama-bench}
threads=${THREADS:-2}
depths=${DEPTHS:-16}
dense=${DENSE:-both}
date -u; lscpu | grep -E "Model name|^CPU\(s\)|L3"; git log --oneline -1
# model, llama.cpp's type, our expert bits, layers, group size, attention bits; SHAPES (those lines
# joined by "|") runs some of them only
shapes=${SHAPES:-"mixtral-8x7b Q2_K 2 8 32 4|mixtral-8x7b Q4_K_M 4 8 64 4|qwen3-30b-a3b Q4_K_M 4 8 64 4|qwen3-30b-a3b Q4_K_M 4 8 64 8|olmoe-1b-7b Q4_K_M 4 8 64 8"}
IFS='|' read -ra specs <<< "$shapes"
for spec in "${specs[@]}"; do
  # shellcheck disable=SC2086  # one shape's six words
  set -- $spec
  echo; echo "== $1, $4 layers: llama.cpp $2 beside MoE Ferry $3-bit experts in groups of $5, $6-bit attention"
  python benchmarks/gguf_random.py --model $1 --layers $4 --type $2 /tmp/cpu-side.gguf
  LD_LIBRARY_PATH=$(dirname "$bin") "$bin" -m /tmp/cpu-side.gguf -p 16 -n 16 -d "$depths" -r 3 -t "$threads" -o md 2>&1 | grep -E "^\|"
  rm -f /tmp/cpu-side.gguf
  python -m benchmarks.cpu_engine --model $1 --layers $4 --expert-bits $3 --group-size $5 --attn-bits $6 \
    --threads "$threads" --prompt-len ${depths//,/ } --new-tokens 16 --dense "$dense"
done
[ "${GPT_OSS:-1}" = 0 ] && exit 0
echo; echo "== gpt-oss-20b, 8 layers: llama.cpp MXFP4 (experts; the rest Q8_0) beside MoE Ferry MXFP4 experts, 8-bit attention"
python benchmarks/gguf_random.py --model gpt-oss-20b --layers 8 --type MXFP4 /tmp/cpu-side.gguf
LD_LIBRARY_PATH=$(dirname "$bin") "$bin" -m /tmp/cpu-side.gguf -p 16 -n 16 -d "$depths" -r 3 -t "$threads" -o md 2>&1 | grep -E "^\|"
rm -f /tmp/cpu-side.gguf
python -m benchmarks.cpu_engine --model gpt-oss-20b --expert-format mxfp4 --layers 8 --attn-bits 8 --threads "$threads" \
  --prompt-len ${depths//,/ } --new-tokens 16 --dense "$dense"
