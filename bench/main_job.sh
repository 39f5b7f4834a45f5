#!/usr/bin/env bash
# The main job against the bench: train_gpt (its default configuration: dp=2 x tp=2 thread
# ranks, ZeRO-1, fp16 with loss scaling, activation checkpointing) and bench_train (small_cpu,
# dp=1, f32), run alternately on the same machine, PAIRS times each. train_gpt's tokens/s is the
# median of its per-step tokens_per_s from step 5 on (metrics.jsonl), bench_train's the median
# of its steps 5-25; prints each pair and the median ratio. Odd pairs run bench_train first, even
# pairs train_gpt first.
#
#   bash bench/main_job.sh
#   PAIRS=5 STEPS=40 bash bench/main_job.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS="${PAIRS:-3}"
STEPS="${STEPS:-25}"
cargo build --release --quiet --example train_gpt
cargo build --release --quiet -p kiln-bench --bin bench_train
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
ratios=()
for i in $(seq 1 "$PAIRS"); do
  # the order alternates (ABBA), so that what a run leaves behind (the other's checkpoint
  # writeback, a warm or cold cache) does not always favour the same side
  rm -rf "$out/run"
  if (( i % 2 == 1 )); then
    b=$(target/release/bench_train --steps "$STEPS" | tail -1)
    target/release/examples/train_gpt --steps "$STEPS" --output "$out/run" > "$out/log" 2>&1
  else
    target/release/examples/train_gpt --steps "$STEPS" --output "$out/run" > "$out/log" 2>&1
    b=$(target/release/bench_train --steps "$STEPS" | tail -1)
  fi
  r=$(python3 - "$b" "$out/run/metrics.jsonl" <<'PY'
import json, statistics, sys
bench = json.loads(sys.argv[1])["tokens_per_s"]
steps = [json.loads(l) for l in open(sys.argv[2])]
per_step = [s["tokens_per_s"] for s in steps if "tokens_per_s" in s][4:]
main = statistics.median(per_step)
print(f"{main / bench} {main:.1f} {bench:.1f}")
PY
)
  read -r ratio main bench <<< "$r"
  echo "pair $i: train_gpt $main tokens/s, bench_train $bench tokens/s: $ratio"
  ratios+=("$ratio")
done
python3 -c 'import statistics,sys; r=[float(x) for x in sys.argv[1:]]; print(f"median train_gpt / bench_train tokens/s over {len(r)} pairs: {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")' "${ratios[@]}"
