#!/usr/bin/env bash
# The last step of a GPU call's command: $OUT packed so that all of it comes back. The run
# tool returns at most 8 files, none more than 2 folders down; on 2026-12-06 a generate
# table's JSON, Markdown and plot were left out of a call that wrote 13 files. When $OUT
# holds more than 8 files or a file 3+ folders down, each folder becomes one <folder>.tgz,
# and if still more than 8 files remain, all but the 6 newest go into more.tgz (env.txt
# kept out; a second run in the same call would overwrite more.tgz: run it once, last).
# Prints what comes back. Usage: `...; bash suites/bench/gpu_pack_out.sh`.
set -u
OUT=${OUT:-/tmp/out}
cd "$OUT" || exit 0
count() { find . -type f | wc -l; }
deep() { find . -mindepth 3 -type f | head -1; }
if [ "$(count)" -gt 8 ] || [ -n "$(deep)" ]; then
  for d in */; do
    [ -d "$d" ] || continue
    d=${d%/}; tar czf "$d.tgz" "$d" && rm -rf "$d"
  done
fi
if [ "$(count)" -gt 8 ]; then
  ls -t | grep -v -x -e env.txt -e more.tgz | tail -n +7 > /tmp/pack_out_rest
  tar czf more.tgz -T /tmp/pack_out_rest && xargs -d '\n' rm -f < /tmp/pack_out_rest
fi
echo "back from \$OUT: $(ls | tr '\n' ' ')"
