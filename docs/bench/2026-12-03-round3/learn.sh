set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
S=/tmp/src; rm -rf $S; mkdir -p $S/moeferry; for d in engine app resources; do ln -s $PWD/$d $S/moeferry/$d; done
export PYTHONPATH=$S:/tmp/site:$PWD PYTHONUNBUFFERED=1
G=/tmp/learn; mkdir -p $G
for r in 1 2 3; do
    timeout $((190 - SECONDS)) python3 benchmarks/hybrid_suite.py $G/h-$r.json 2g32u4 12GiB-p0 > $G/h-$r.md 2> $G/h-$r.log
    echo "run $r exit $? at $SECONDS s"
    grep -E "^  (lru|hybrid) |misses on the CPU|learned" $G/h-$r.log
done
tar czf $OUT/learn.tgz -C $G .
