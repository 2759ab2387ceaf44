#!/usr/bin/env bash
# An A/B of the one-shot rows (docs/benchmarks.md, GPU run 145): two builds' `gpufeed-bench
# one-shot` children alternated N times (default 10) on one machine start, four kinds each
# round (`load_file_on`, `safetensors::load_on`, a fresh Loader's first load of the file and of
# the checkpoint), on a 4 GiB file of random bytes and a 4 GiB checkpoint, both warm; one JSON
# line per child in $OUT/ab.jsonl (or ./ab.jsonl), then medians (min-max) per kind and build.
#
# Put the two binaries beside this script as `old` and `new` (stripped `gpufeed-bench`s: the
# old one built in a worktree of the older commit, `cargo build --release -p gpufeed-benches`),
# carry the folder to the GPU machine and run `N=10 bash ab.sh` there (needs torch and
# safetensors for the checkpoint).
set -u
here="$(cd "$(dirname "$0")" && pwd)"; out="${OUT:-$PWD}"
N="${N:-10}"
# The data in a directory of this run's own (a fixed name in /tmp could be another user's, or
# a link to somewhere else), removed at the end.
data="$(mktemp -d "${TMPDIR:-/tmp}/gpufeed-ab.XXXXXX")" || exit 1
trap 'rm -rf "$data"' EXIT
f=$data/file.bin; c=$data/ckpt.safetensors
python3 -c "
import os,sys
with open(sys.argv[1],'wb') as o:
    for _ in range(64): o.write(os.urandom(64<<20))" $f || exit 1
python3 -c "
import sys,torch
from safetensors.torch import save_file
g=torch.Generator().manual_seed(5)
save_file({f'w{i:02d}': torch.randn(32<<20, generator=g) for i in range(32)}, sys.argv[1])" $c || exit 1
cat $f $c > /dev/null
chmod +x "$here/old" "$here/new"
for i in $(seq 1 "$N"); do
  if [ $((i % 2)) = 1 ]; then order="old new"; else order="new old"; fi
  for b in $order; do
    for mode in file-on ckpt-on file ckpt; do
      case $mode in
        file-on) args=(--path $f --on);; ckpt-on) args=(--path $c --checkpoint --on);;
        file) args=(--path $f);; ckpt) args=(--path $c --checkpoint);;
      esac
      line=$("$here/$b" one-shot "${args[@]}" 2>>"$out/ab.err") || { echo "FAILED $b $mode"; continue; }
      echo "{\"build\":\"$b\",\"mode\":\"$mode\",\"rep\":$i,\"run\":$line}" >> "$out/ab.jsonl"
    done
  done
done
python3 - "$out/ab.jsonl" <<'PY'
import json,sys,statistics as st
rows=[json.loads(l) for l in open(sys.argv[1])]
keys=sorted({(r["mode"],r["build"]) for r in rows})
for mode in ["file-on","ckpt-on","file","ckpt"]:
    for b in ["old","new"]:
        rs=[r["run"] for r in rows if r["mode"]==mode and r["build"]==b]
        if not rs: continue
        k="load_ms" if "load_ms" in rs[0] else None
        vals={kk:[x[kk] for x in rs] for kk in rs[0] if isinstance(rs[0][kk],(int,float))}
        def f(v): return f"{st.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
        print(mode,b,len(rs),{kk:f(v) for kk,v in vals.items() if kk.endswith("_ms")})
PY
