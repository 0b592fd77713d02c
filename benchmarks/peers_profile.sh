#!/bin/sh
# Where does the time of benchmarks/peers.py's "ours" go? Runs that method alone on the GPU machine
# and samples the processes beside it: ps and per-thread top three times, vmstat, CPU and I/O
# pressure, and, when a py-spy binary is at $PY_SPY (default /tmp/spy/py-spy), 12 s of py-spy
# samples of extract.py and of every sglang process. Everything is packed into one file,
# $OUT/peers-profile.tar.gz (a device call brings back only a few files). Usage, from the
# repository root with .gpu-bundle and .gpu-patched carried (docs/peers.md):
#   sh benchmarks/peers_profile.sh $OUT [extra peers.py flags]
set -u
OUT=${1:?usage: sh benchmarks/peers_profile.sh OUT [peers.py flags]}
shift
P_DIR=$OUT/peers-profile
mkdir -p "$P_DIR"
SPY=${PY_SPY:-/tmp/spy/py-spy}
sh .gpu-bundle/unpack.sh /tmp/site >/dev/null 2>&1
{ nproc; free -g | head -2; df -h /tmp; } > "$P_DIR/machine.txt" 2>&1
PYTHONPATH=/tmp/site:src timeout 400 python3 benchmarks/peers.py --model /tmp/peers-model --methods ours \
    --work /tmp/pw --keep-work --out "$P_DIR/peers-ours.json" "$@" 2> "$P_DIR/peers-ours.log" &
P=$!
i=0
while [ $i -lt 400 ] && ! grep -q "extracting " /tmp/pw/ours/extract.log 2>/dev/null; do sleep 1; i=$((i + 1)); done
echo "extract started after $i s" >> "$P_DIR/machine.txt"
sleep 8
vmstat 1 15 > "$P_DIR/vmstat.txt" 2>&1 &
cat /proc/pressure/cpu /proc/pressure/io > "$P_DIR/pressure-before.txt" 2>&1
if [ -x "$SPY" ]; then
  for p in $(pgrep -f "tools/extract.py|sglang") ; do
    "$SPY" record --pid "$p" -d 12 -r 50 -f raw --threads --nonblocking -o "$P_DIR/spy-$p.txt" > "$P_DIR/spy-$p.log" 2>&1 &
  done
fi
for k in 1 2 3; do
  echo "=== snapshot $k $(date +%T)"
  ps -eo pid,ppid,pcpu,rss,nlwp,args --sort=-pcpu | cut -c1-220 | head -14
  top -H -b -n 2 -d 2 -w 200 | awk '/^top -/{f++} f==2' | head -45
  sleep 2
done > "$P_DIR/threads.txt" 2>&1
cat /proc/pressure/cpu /proc/pressure/io > "$P_DIR/pressure-after.txt" 2>&1
wait $P
echo "peers exit $?" >> "$P_DIR/machine.txt"
cp /tmp/pw/ours/*.log "$P_DIR/" 2>/dev/null
cp /tmp/pw/ours/dataset/manifest.json "$P_DIR/" 2>/dev/null
tar -czf "$OUT/peers-profile.tar.gz" -C "$OUT" peers-profile && rm -rf "$P_DIR"
tar -tzf "$OUT/peers-profile.tar.gz" | head -40
