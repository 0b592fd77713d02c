#!/bin/bash
# Issue 45's peers runs on the GPU machine, one call each: unpack the GPU bundle (whole in .gpu-bundle, or
# part0 kept in /tmp/keep by an earlier call plus .gpu-b/part1), build the target once at /tmp/peers-model,
# then benchmarks/peers.py with the limit beside ours's methods, dumps and datasets in /dev/shm; the
# Mooncake payload (benchmarks/mooncake_payload.py --out .gpu-m/mooncake) when a method needs it.
# Writes into $OUT: peers.json, peers.png, peers.log, top.log.gz (top every 5 s) and, per ours method,
# its last extract log and the end of its server log. Warm-up up to 60 s a server (it ends once the
# rates settle): run 18's cold limit, cut at 20 s after one round, ran 63-81k tokens/s against 82-95k
# warm. Usage, from the repository root, with
# .gpu-bundle (or .gpu-b), .gpu-patched and, for ours-mooncake, .gpu-m carried (docs/peers.md):
#   bash benchmarks/peers_gpu.sh METHODS BUDGET_S [DUMP_WRITERS (4)] [REPEATS (3)]
#   e.g. bash benchmarks/peers_gpu.sh limit,ours-processes 470 4
# PEERS_EXTRA: more peers.py flags, e.g. PEERS_EXTRA="--dump-gil-switch-ms 1"
if [ $# -lt 2 ]; then
  echo "error: METHODS and BUDGET_S are required; fix: bash benchmarks/peers_gpu.sh limit,ours-processes 470" >&2; exit 2
fi
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
  echo "error: OUT is not an existing directory; fix: run it in a device call, or set OUT=DIR" >&2; exit 2
fi
METHODS=$1
BUDGET=$2
T0=$(date +%s)
if [ ! -f /tmp/site/sglang/__init__.py ]; then
  if [ -f .gpu-bundle/bundle.tar.xz ]; then sh .gpu-bundle/unpack.sh /tmp/site || exit 3
  else mkdir -p /tmp/bundle && cat /tmp/keep/part0 .gpu-b/part1 > /tmp/bundle/bundle.tar.xz && \
    cp .gpu-b/SHA256SUMS .gpu-b/unpack.sh /tmp/bundle/ && sh /tmp/bundle/unpack.sh /tmp/site || exit 3; fi
fi
echo "unpacked at $(( $(date +%s) - T0 )) s"; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total --format=csv
if [ ! -f /tmp/peers-model/config.json ]; then
  PYTHONPATH=src python3 -c "
import sys, types; sys.path[:0] = ['benchmarks', 'src']
import peers
r = peers.Run(types.SimpleNamespace(cpu=False, work='/tmp/pw1', model='/tmp/peers-model'), peers.PROFILES['gpu'])
print(r.gpu_model())" || exit 4
fi
echo "target at $(( $(date +%s) - T0 )) s"
MC=""
if [[ "$METHODS" == *mooncake* ]]; then
  [ -f /tmp/mc/env.sh ] || sh .gpu-m/mooncake/unpack.sh /tmp/mc || exit 3
  . /tmp/mc/env.sh; MC="--mooncake-site /tmp/mc"
fi
# every 5 s: the processes, then the busiest threads (the dump's writer threads beside the scheduler's)
(while true; do date +%T; top -b -n1 -w 220 | head -32; echo THREADS; top -H -b -n1 -w 220 | sed -n 7,40p;
  S=$(pgrep -f 'sglang::scheduler' | head -1); [ -n "$S" ] && { echo "SCHEDULER $S tid comm utime stime (ticks)";
  for t in /proc/$S/task/*; do awk '{print $1, $2, $14, $15}' $t/stat 2>/dev/null; done; }; sleep 5; done) > /tmp/top.log 2>&1 &
TOP=$!
rm -rf /dev/shm/pw
set -o pipefail
PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site:src python3 benchmarks/peers.py \
  --model /tmp/peers-model --methods "$METHODS" $MC --extract-processes 8 --dump-writers "${3:-4}" \
  --repeats "${4:-3}" ${PEERS_EXTRA:-} --method-s 30 --warm-s 60 --budget-s "$BUDGET" --dump-dir /dev/shm --disk-dir /var/tmp \
  --work /dev/shm/pw --out "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log"
rc=$?
kill $TOP
gzip -c /tmp/top.log > "$OUT/top.log.gz"
for m in ours-processes ours-fp8 ours-fp8-disk ours-mooncake; do
  [ -f /dev/shm/pw/$m/extract-rep3.log ] && cp /dev/shm/pw/$m/extract-rep3.log "$OUT/$m-extract-rep3.log"
  [ -f /dev/shm/pw/$m/server.log ] && tail -c 300000 /dev/shm/pw/$m/server.log | gzip > "$OUT/$m-server.log.gz"
done
echo "rc $rc after $(( $(date +%s) - T0 )) s"
exit $rc
