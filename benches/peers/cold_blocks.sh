#!/usr/bin/env bash
# The block layer around cold reads (issue 42; docs/benchmarks.md, GPU run 189): a 4 GiB file
# of random bytes, evicted before each read, read by `gpufeed load --strategy direct`, by
# `--strategy gds` and by KvikIO (one thread), three rounds; per read, from the disk's
# /sys/block/DEV/stat: requests, their mean size, the mean in flight, ms per request.
# Not run by the bench. Usage: bash benches/peers/cold_blocks.sh GPUFEED_BIN FILE
# (cuFile needs the file system's udev record; KvikIO from PYTHONPATH).
set -u
G=${1:?the gpufeed CLI}; F=${2:?a file path (made if missing)}
out=$(mktemp) && trap 'rm -f "$out"' EXIT
dev=$(lsblk -no PKNAME $(df --output=source "$(dirname "$F")" | tail -1) 2>/dev/null | head -1); [ -n "$dev" ] || dev=vda
echo "device $dev: $(for k in max_sectors_kb max_hw_sectors_kb nr_requests scheduler read_ahead_kb rotational; do printf '%s=%s ' $k "$(cat /sys/block/$dev/queue/$k 2>/dev/null)"; done)"
grep -E '"(max_direct_io_size_kb|max_device_cache_size_kb|per_buffer_cache_size_kb|max_io_threads|max_io_queue_depth|parallel_io|min_io_threshold_size_kb|max_request_parallelism|io_batchsize|allow_compat_mode)"' /etc/cufile.json | tr -s ' '
[ -f "$F" ] || { head -c $((4<<30)) /dev/urandom > "$F"; sync; }
ev() { python3 -c "import os,sys; fd=os.open(sys.argv[1],os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd,0,0,os.POSIX_FADV_DONTNEED)" "$F"; }
st() { cat /sys/block/$dev/stat; }
rep() { # before after wall label
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import sys
a=list(map(int,sys.argv[1].split())); b=list(map(int,sys.argv[2].split())); wall=float(sys.argv[3])
d=[y-x for x,y in zip(a,b)]
reads,merged,sect,rtime=d[0],d[1],d[2],d[3]; ticks,inq=d[9],d[10]
print(f"  {sys.argv[4]:22s} reads {reads:7d} merged {merged:6d} avg {sect*512/max(reads,1)/1024:7.1f} KiB  MB {sect*512/1e6:7.0f}  busy {ticks/1000/max(wall,1e-9):.2f}  avg-inflight {inq/max(ticks,1):.1f}  rd-ms/req {rtime/max(reads,1):.2f}  wall {wall:.2f}s -> {sect*512/wall/1e9:.2f} GB/s")
PY
}
for r in 1 2 3; do
  ev; a=$(st); t0=$(date +%s.%N); $G load "$F" --strategy direct --json > $out 2>/dev/null; t1=$(date +%s.%N); b=$(st); g=$(python3 -c "import json,sys;print(round(json.load(open(sys.argv[1]))['gbps'],3))" "$out" 2>&1 | tail -c 60); rep "$a" "$b" $(awk "BEGIN{print $t1-$t0}") "gpufeed direct $g"
  ev; a=$(st); t0=$(date +%s.%N); $G load "$F" --strategy gds --json > $out 2>/dev/null; t1=$(date +%s.%N); b=$(st); g=$(python3 -c "import json,sys;print(round(json.load(open(sys.argv[1]))['gbps'],3))" "$out" 2>&1 | tail -c 60); rep "$a" "$b" $(awk "BEGIN{print $t1-$t0}") "gpufeed gds $g"
  coproc K { python3 "$(dirname "$0")/cold_blocks_kvikio.py" "$F" 1 2>&1; }
  while read -r line <&${K[0]}; do [[ $line == READY* ]] && break; done; ev; a=$(st); t0=$(date +%s.%N); echo go >&${K[1]}; while read -r line <&${K[0]}; do [[ $line == GBPS* ]] && break; done; t1=$(date +%s.%N); b=$(st); wait $K_PID 2>/dev/null
  rep "$a" "$b" $(awk "BEGIN{print $t1-$t0}") "kvikio 1 thr ($line)"
done
