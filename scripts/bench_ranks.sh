#!/usr/bin/env bash
# Quickstart step time on 2 ranks × 1 thread against 1 rank × 1 thread and 1 rank × 2 threads,
# measured side by side: ROUNDS rounds, each running the three configurations one after the
# other for STEPS steps; the figure of a configuration is its median step time over every
# step after the first of every round (the first step pays for warming up), and the ratios
# are of those medians.
#
#   scripts/bench_ranks.sh [STEPS] [ROUNDS]      defaults: 20 steps, 3 rounds
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-20}
rounds=${2:-3}
cargo build --quiet --bin braid
braid=target/debug/braid
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  $braid run examples/quickstart.rlhf --run-dir "$out/one1-$r" --steps "$steps" --threads 1 --plain 2>/dev/null >/dev/null
  $braid run examples/quickstart.rlhf --run-dir "$out/one2-$r" --steps "$steps" --threads 2 --plain 2>/dev/null >/dev/null
  $braid launch --nproc-per-node 2 run examples/quickstart.rlhf --run-dir "$out/two1-$r" --steps "$steps" --threads 1 --plain 2>/dev/null >/dev/null
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def steps(name):
    t = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(f"{out}/{name}-{r}/metrics.jsonl")]
        t += [l["time/step"] for l in lines[1:]]
    return statistics.median(t), len(t)
rows = [("1 rank × 1 thread", "one1"), ("1 rank × 2 threads", "one2"), ("2 ranks × 1 thread", "two1")]
base = steps("one1")[0]
print("| configuration | median s/step | steps timed | speed-up over 1 rank × 1 thread |")
print("| --- | --- | --- | --- |")
for label, name in rows:
    m, n = steps(name)
    print(f"| {label} | {m:.3f} | {n} | {base / m:.2f}× |")
PY
