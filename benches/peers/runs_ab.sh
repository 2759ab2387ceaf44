#!/usr/bin/env bash
# A/B of the drop-in's prefetch settings on the GPU machine (issue 38): the runs' GPU tests,
# then `dropin.py 3` on checkpoints of BF16 tensors in /dev/shm (warm) under each variant of
# environment variables, ROUNDS times; then the drop-in's GPU tests with the defaults, and
# timelines of the loads. Not run by the bench.
#
# Usage, from the repository root of a `cargo xtask device` build carried with target/device
# (run.sh, bin.tar.xz, wheels, st09, and pytest's wheels in pywheels/ where the machine lacks
# pytest):
#   ROUNDS=2 bash benches/peers/runs_ab.sh
# SHAPES (default "4:4096": GiB:tensors, space-separated) names the checkpoints, METHODS
# (default "gpufeed safe_open get_tensor,safetensors prefetch threads=16") dropin.py's rows,
# VARIANTS (space-separated "label:VAR=VALUE,VAR=VALUE"; default "off:" runs off, 2 GiB ahead,
# the defaults before GPU run 236, and "on:" runs of 4 GiB with 4 GiB ahead, the defaults
# since) what each pass sets, TESTS=0 skips the tests, TIMELINE (e.g. "get_tensor prefetch")
# the methods whose `timeline.py` of the first shape is kept (GPUFEED_LOG=debug, the default
# settings), DEVICE_DIR (default target/device) the build to use. Results in $OUT (or a new
# directory it names): dropin-SHAPE-ROUND-LABEL.json, t-*.log, timeline-METHOD.log.
set -u
here="${DEVICE_DIR:-target/device}"
rounds="${ROUNDS:-2}"
# run.sh's set-up (the binaries unpacked, gpufeed, safetensors 0.9 and pytest installed in its
# private folder) and its variables.
eval "$(bash "$here/run.sh" env)" || exit 1
# A private directory (mktemp: 0700, a name no one else chose) for the checkpoint, removed at
# the end.
shm=$(mktemp -d /dev/shm/gpufeed-runs-ab.XXXXXX) || exit 1
trap 'rm -rf "$shm"' EXIT
out="${OUT:-$(mktemp -d)}" || exit 1
echo "results in $out"
nvidia-smi --query-gpu=name --format=csv,noheader
tests="${TESTS:-1}"
if [ "$tests" != 0 ]; then
  echo "=== the runs' GPU tests"
  "$here/tests/gpufeed-load-load" parts --test-threads=2 > "$out/t-parts.log" 2>&1
  echo "gpufeed-load parts: rc=$? $(grep '^test result' "$out/t-parts.log")"
  "$here/tests/gpufeed-safetensors-safetensors" prefetch --test-threads=2 > "$out/t-prefetch.log" 2>&1
  echo "gpufeed-safetensors prefetch: rc=$? $(grep '^test result' "$out/t-prefetch.log")"
  grep -E "panicked|FAILED" -A5 "$out/t-parts.log" "$out/t-prefetch.log" | head -n 30
fi

shapes="${SHAPES:-4:4096}"
methods="${METHODS:-gpufeed safe_open get_tensor,safetensors prefetch threads=16}"
variants="${VARIANTS:-off:GPUFEED_PREFETCH_RUN_MIB=0,GPUFEED_SWEEP_AHEAD_MIB=2048 on:GPUFEED_PREFETCH_RUN_MIB=4096,GPUFEED_SWEEP_AHEAD_MIB=4096}"
first=
for shape in $shapes; do
  gib=${shape%%:*} n=${shape##*:}
  f="$shm/ab-$gib-$n.safetensors"
  first="${first:-$f}"
  (cd benches/peers && python3 -c "import casts; casts.make('$f', 'BF16', $gib << 30, $n)") || exit 1
  for round in $(seq "$rounds"); do
    for variant in $variants; do
      label=${variant%%:*} sets=${variant#*:}
      tag="$gib-$n-$round-$label"
      echo "=== $gib GiB / $n tensors, round $round, $label (${sets:-the defaults})"
      # The variant's variables, in a subshell of their own.
      (
        IFS=, ; for kv in $sets; do [ -n "$kv" ] && export "${kv?}"; done; unset IFS
        DROPIN_METHODS="$methods" timeout 300 python3 benches/peers/dropin.py 3 "$f" \
          > "$out/dropin-$tag.json" 2> "$out/dropin-$tag.err"
      ) || { echo "dropin.py failed"; tail -n 5 "$out/dropin-$tag.err"; continue; }
      python3 benches/peers/dropin.py --summary "$out/dropin-$tag.json"
    done
  done
  [ "$f" = "$first" ] || rm -f "$f"
done

for method in ${TIMELINE:-}; do
  echo "=== timeline.py $method on $first (the defaults)"
  GPUFEED_LOG=debug timeout 120 python3 benches/peers/timeline.py "$method" "$first" \
    > /dev/null 2> "$out/timeline-$method.log"
  echo "rc=$?"
  # The third load's lines (the log keeps all three).
  awk '/^PY ===== .* rep 2/ { p = 1 } p' "$out/timeline-$method.log" \
    | grep -E "^PY |prefetch chunk|prefetch starts" | cut -c1-220
done
rm -f "$first"

if [ "$tests" != 0 ]; then
  echo "=== test_safe_open_gpu.py with the defaults"
  (cd crates/gpufeed-py/tests && \
    PYTHONPATH="$GPUFEED_SAFETENSORS09:${GPUFEED_DEVICE_PYTEST:+$GPUFEED_DEVICE_PYTEST:}$PYTHONPATH" \
    timeout 200 python3 -m pytest -q -p no:cacheprovider test_safe_open_gpu.py > "$out/t-py.log" 2>&1)
  echo "rc=$?"; tail -n 1 "$out/t-py.log"; grep -E "^(FAILED|ERROR)" "$out/t-py.log" | head
fi
