#!/usr/bin/env bash
# Throwaway device script (not shipped): kernel variants, or host-overhead branch vs main.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
link() {  # tree -> PYTHONPATH entry
    local S=/tmp/src-$(basename $1); rm -rf $S; mkdir -p $S/moeferry
    for d in engine app resources; do ln -s $1/$d $S/moeferry/$d; done; echo $S
}
export PYTHONUNBUFFERED=1
case $1 in
kernel)
    export PYTHONPATH=$(link $PWD):/tmp/site:$PWD
    lscpu | grep -E "Model name|^CPU\(s\)|Thread|Core|Socket|L3|MHz"
    python3 -c "from llvmlite import binding as b; f = b.get_host_cpu_features(); print(b.get_host_cpu_name(), {k: f.get(k) for k in ('avx512bw', 'avx512vnni', 'avxvnni', 'amx-int8', 'avx512fp16')})"
    python3 -m pytest -q tests/engine/kernels/test_hqq_cpu.py -p no:cacheprovider 2>&1 | tail -2
    echo "tests at $SECONDS s"
    V=.carry/kvar
    timeout 150 python3 $V/ab.py $V/base.py $V/pf.py $V/pf2.py engine/kernels/hqq_cpu.py --threads 16 8 --group 32 --rounds 11 --rotate-gib 0.5 2>&1 | tee $OUT/ab.log
    timeout 100 python3 $V/ab.py $V/base.py engine/kernels/hqq_cpu.py --threads 16 8 --group 32 --rounds 11 --rotate-gib 0.5 --expert 2>&1 | tee -a $OUT/ab.log
    timeout 60 python3 $V/ab.py $V/base.py engine/kernels/hqq_cpu.py --threads 16 --group 16 --rounds 9 --rotate-gib 0.5 --expert 2>&1 | grep ms | tee -a $OUT/ab.log
    echo "ab at $SECONDS s"
    G=/tmp/hybrid; rm -rf $G; mkdir -p $G
    for w in 2g32 2g32u4; do
        timeout $((470 - SECONDS)) python3 benchmarks/hybrid_suite.py $G/hybrid-$w.json $w 12GiB-p0 desktop-p0 > $G/hybrid-$w.md 2> $G/hybrid-$w.log
        echo "hybrid suite $w exit $? at $SECONDS s"
        grep -E "^  (lru|hybrid) |misses on the CPU|layers/token|learned" $G/hybrid-$w.log | grep -v " 0.0[0-9] layers/token"
    done
    timeout $((560 - SECONDS)) python3 -m pytest -q -m gpu tests/engine/runtime/test_hybrid_cuda.py -p no:cacheprovider > $G/gpu-tests.log 2>&1
    echo "GPU tests exit $? at $SECONDS s"; tail -2 $G/gpu-tests.log
    tar czf $OUT/kernel.tgz -C $G . ;;
host)
    H=$PWD/.carry/host
    G=/tmp/host; rm -rf $G; mkdir -p $G
    ( cd $H && PYTHONPATH=$(link $H):/tmp/site:$H timeout 240 python3 -m pytest -q -m gpu tests/engine/runtime -p no:cacheprovider \
        --ignore=tests/engine/api/test_serve.py > $G/gpu-tests-host.log 2>&1 ); echo "host GPU tests exit $? at $SECONDS s"; tail -3 $G/gpu-tests-host.log
    for tree in $PWD $H; do
        name=$(basename $tree)
        ( cd $tree && PYTHONPATH=$(link $tree):/tmp/site:$tree timeout 100 python3 -m moeferry.engine.cli bench --vram-budget 12GiB --modes lru \
            --kernels fused --prompt-len 128 --routing uniform --expert-group-size 32 2>> $G/bench-$name.log | grep "| lru" | sed "s|^|$name mixtral |" )
    done
    for tree in $PWD $H; do
        name=$(basename $tree)
        ( cd $tree && PYTHONPATH=$(link $tree):/tmp/site:$tree timeout 120 python3 -m moeferry.engine.cli bench --model qwen3-30b-a3b --expert-bits 4 \
            --vram-budget 12GiB --modes lru --kernels fused --prompt-len 128 --routing uniform 2>> $G/bench-$name.log | grep "| lru" | sed "s|^|$name qwen3 |" )
    done
    echo "benches done at $SECONDS s"
    export PYTHONPATH=$(link $PWD):/tmp/site:$PWD
    timeout $((560 - SECONDS)) python3 benchmarks/hybrid_suite.py $G/hybrid-14.json 2g32 12GiB-p0-14threads > $G/hybrid-14.md 2> $G/hybrid-14.log
    echo "hybrid 14 threads exit $? at $SECONDS s"
    grep -E "^  (lru|hybrid) |misses on the CPU|layers/token|learned" $G/hybrid-14.log | grep -v " 0.0[0-9] layers/token"
    tar czf $OUT/host.tgz -C $G . ;;
esac
