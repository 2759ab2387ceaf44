#!/usr/bin/env bash
# A/B of two gpufeed wheels on the GPU machine (docs/benchmarks.md, GPU run 245): the wheel in
# OLD_WHEELS (default target/abold, e.g. a `cargo xtask device` build of the commit before,
# copied there) against target/device/wheels, alternated: `dropin.py 3` on 4 GiB in 4,096 BF16
# tensors in /dev/shm per ROUNDS (default 2) and ORDER (default "old new"), METHODS as
# dropin.py's DROPIN_METHODS, then `pertensor.py` once per word of PERTENSOR (e.g. "old new
# new old"). Carry target/device and the old wheel's folder; results in $OUT. Not run by the
# bench.
set -u
eval "$(bash target/device/run.sh env)" >/dev/null || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
old=$(mktemp -d /tmp/oldsite.XXXXXX)
python3 -m pip install -q --no-index --no-deps --target "$old" "${OLD_WHEELS:-target/abold}"/*.whl || exit 1
site=$(python3 -c "import gpufeed, os; print(os.path.dirname(os.path.dirname(gpufeed.__file__)))")
new_pp="$PYTHONPATH"
old_pp="${PYTHONPATH/$site/$old}"
for v in old new; do
  pp=$([ $v = old ] && echo "$old_pp" || echo "$new_pp")
  echo "$v: $(PYTHONPATH=$pp python3 -c 'import gpufeed; print(gpufeed.__file__)')"
done
out="${OUT:-$(mktemp -d)}"; echo "results in $out"
shm=$(mktemp -d /dev/shm/ab.XXXXXX); trap 'rm -rf "$shm" "$old"' EXIT
f=$shm/ab-4-4096.safetensors
(cd benches/peers && python3 -c "import casts; casts.make('$f', 'BF16', 4 << 30, 4096)") || exit 1
M="${METHODS:-gpufeed safe_open get_tensor,gpufeed safe_open prefetch,safetensors prefetch threads=16}"
for round in $(seq "${ROUNDS:-2}"); do
  for v in ${ORDER:-old new}; do
    pp=$([ $v = old ] && echo "$old_pp" || echo "$new_pp")
    echo "=== round $round, $v"
    PYTHONPATH="$pp" DROPIN_METHODS="$M" timeout 200 python3 benches/peers/dropin.py 3 "$f" \
      > "$out/d-$round-$v.json" 2> "$out/d-$round-$v.err" || { tail -3 "$out/d-$round-$v.err"; continue; }
    python3 benches/peers/dropin.py --summary "$out/d-$round-$v.json"
  done
done
for v in ${PERTENSOR:-}; do
  pp=$([ $v = old ] && echo "$old_pp" || echo "$new_pp")
  echo "=== pertensor.py, $v"
  PYTHONPATH="$pp" timeout 120 python3 benches/peers/pertensor.py 2>&1 | grep -v Warn
done
