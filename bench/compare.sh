#!/usr/bin/env bash
# kiln against PyTorch on the CPU, run alternately on the same machine: bench_train and
# bench/pytorch_ref.py on the same model and batch, PAIRS times each, then the median ratio.
#
#   bash bench/compare.sh                 # small_cpu (d256, 4 layers, ctx 128, batch 8), f32
#   bash bench/compare.sh --d-model 512 --layers 8 --heads 8 --ctx 256 --batch 4
#   DTYPE=bf16 bash bench/compare.sh      # kiln bf16 against torch.autocast("cpu", bfloat16)
#   PAIRS=5 bash bench/compare.sh
#
# PyTorch is installed into bench/.venv on first use from PyPI (TORCH_SPEC picks the version;
# PyPI's Linux wheel brings its CUDA libraries, 5.4 GB in all, and runs on the CPU without a
# GPU). Not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS="${PAIRS:-3}"
DTYPE="${DTYPE:-f32}"
VENV=bench/.venv
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${TORCH_SPEC:-torch}" numpy
fi
cargo build --release --quiet -p kiln-bench --bin bench_train
# both default to small_cpu's sizes (d256, 4 layers, 4 heads, ctx 128, vocab 8192, batch 8)
args=("$@")
ratios=()
for i in $(seq 1 "$PAIRS"); do
  k=$(target/release/bench_train ${args[@]+"${args[@]}"} --dtype "$DTYPE" | tail -1)
  t=$(cd bench && ../"$VENV"/bin/python pytorch_ref.py ${args[@]+"${args[@]}"} --dtype "$DTYPE" | tail -1)
  echo "kiln    $k"
  echo "pytorch $t"
  r=$(python3 -c 'import json,sys; k=json.loads(sys.argv[1]); t=json.loads(sys.argv[2]); print(k["tokens_per_s"]/t["tokens_per_s"])' "$k" "$t")
  ratios+=("$r")
  echo "pair $i: kiln / pytorch = $r"
done
python3 -c 'import statistics,sys; r=[float(x) for x in sys.argv[1:]]; print(f"median kiln / pytorch tokens/s over {len(r)} pairs: {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")' "${ratios[@]}"
