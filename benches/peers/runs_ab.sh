#!/usr/bin/env bash
# Issue 38's reload with and without runs (`GPUFEED_PREFETCH_RUN_MIB`: a prefetch's chunks
# that follow one another loaded as one staged transfer), on the GPU machine: the runs' GPU
# tests, then `dropin.py 3` on a 4 GiB checkpoint of 4,096 BF16 tensors of 1 MiB in /dev/shm
# (warm), `get_tensor` of each and safetensors 0.9's `prefetch(threads=16)`, runs off (0 /
# sweep ahead 2048 MiB, the defaults before GPU run 236) and on (4096 / 4096, the defaults
# since), ROUNDS times; then the drop-in's GPU tests with runs on. Not run by the bench.
#
# Usage, from the repository root of a `cargo xtask device` build carried with target/device
# (run.sh, bin.tar.xz, wheels, st09, and pytest's wheels in pywheels/ where the machine lacks
# pytest):
#   ROUNDS=2 bash benches/peers/runs_ab.sh
# SHAPES (default "4:4096": GiB:tensors, space-separated) names the checkpoints, METHODS
# (default "gpufeed safe_open get_tensor,safetensors prefetch threads=16") dropin.py's rows.
# Results in $OUT (or a new directory it names): dropin-SHAPE-ROUND-MODE.json, t-*.log.
set -u
here=target/device
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
echo "=== the runs' GPU tests"
"$here/tests/gpufeed-load-load" parts --test-threads=2 > "$out/t-parts.log" 2>&1
echo "gpufeed-load parts: rc=$? $(grep '^test result' "$out/t-parts.log")"
"$here/tests/gpufeed-safetensors-safetensors" prefetch --test-threads=2 > "$out/t-prefetch.log" 2>&1
echo "gpufeed-safetensors prefetch: rc=$? $(grep '^test result' "$out/t-prefetch.log")"
grep -E "panicked|FAILED" -A5 "$out/t-parts.log" "$out/t-prefetch.log" | head -n 30

shapes="${SHAPES:-4:4096}"
methods="${METHODS:-gpufeed safe_open get_tensor,safetensors prefetch threads=16}"
for shape in $shapes; do
  gib=${shape%%:*} n=${shape##*:}
  f="$shm/ab-$gib-$n.safetensors"
  (cd benches/peers && python3 -c "import casts; casts.make('$f', 'BF16', $gib << 30, $n)") || exit 1
  for round in $(seq "$rounds"); do
    for mode in off on; do
      if [ "$mode" = off ]; then run=0; ahead=2048; else run=4096; ahead=4096; fi
      tag="$gib-$n-$round-$mode"
      echo "=== $gib GiB / $n tensors, round $round, runs $mode (GPUFEED_PREFETCH_RUN_MIB=$run GPUFEED_SWEEP_AHEAD_MIB=$ahead)"
      GPUFEED_PREFETCH_RUN_MIB=$run GPUFEED_SWEEP_AHEAD_MIB=$ahead DROPIN_METHODS="$methods" \
        timeout 240 python3 benches/peers/dropin.py 3 "$f" > "$out/dropin-$tag.json" \
        2> "$out/dropin-$tag.err" || { echo "dropin.py failed"; tail -n 5 "$out/dropin-$tag.err"; continue; }
      python3 - "$out/dropin-$tag.json" <<'PY'
import json, sys
for path, v in json.load(open(sys.argv[1])).items():
    for method, r in v["rows"].items():
        if "error" in r:
            print(f"{method}: {r['error']}")
            continue
        gb = lambda xs: " ".join(f"{x:.1f}" for x in xs)
        print(f"{method:40s} fresh {gb(r['fresh'])} / again {gb(r['again'])} checksum {r['checksum']}")
PY
    done
  done
  rm -f "$f"
done

echo "=== test_safe_open_gpu.py with runs on"
(cd crates/gpufeed-py/tests && GPUFEED_PREFETCH_RUN_MIB=4096 GPUFEED_SWEEP_AHEAD_MIB=4096 \
  PYTHONPATH="$GPUFEED_SAFETENSORS09:${GPUFEED_DEVICE_PYTEST:+$GPUFEED_DEVICE_PYTEST:}$PYTHONPATH" \
  timeout 200 python3 -m pytest -q -p no:cacheprovider test_safe_open_gpu.py > "$out/t-py.log" 2>&1)
echo "rc=$?"; tail -n 1 "$out/t-py.log"; grep -E "^(FAILED|ERROR)" "$out/t-py.log" | head
