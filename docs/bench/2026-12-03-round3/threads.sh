set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
S=/tmp/src; rm -rf $S; mkdir -p $S/moeferry; for d in engine app resources; do ln -s $PWD/$d $S/moeferry/$d; done
export PYTHONPATH=$S:/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/thr; mkdir -p $G
for w in 2g32u4; do
    timeout $((220 - SECONDS)) python3 benchmarks/hybrid_suite.py $G/h-$w.json $w 12GiB-p0 12GiB-p0-15threads 12GiB-p0-14threads > $G/h-$w.md 2> $G/h-$w.log
    echo "$w exit $? at $SECONDS s"
    grep -E "^  (lru|hybrid) |misses on the CPU|learned" $G/h-$w.log
done
tar czf $OUT/threads.tgz -C $G .
