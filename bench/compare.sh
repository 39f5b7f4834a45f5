#!/usr/bin/env bash
# kiln against PyTorch on the CPU, run alternately on the same machine: bench_train and
# bench/pytorch_ref.py on the same model and batch, PAIRS times each (odd pairs kiln first, even
# pairs PyTorch first), then the median ratio. Both print the model's sizes and parameter count;
# the script stops if they differ.
#
#   bash bench/compare.sh                 # small_cpu (d256, 4 layers, ctx 128, batch 8), f32
#   bash bench/compare.sh --arch llama    # llama_cpu (d256, 4 layers, 8 heads, 2 kv heads, ffn 704)
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
# both default to small_cpu's sizes (d256, 4 layers, 4 heads, ctx 128, vocab 8192, batch 8), or
# with --arch llama to llama_cpu's; the size flags (--d-model, --layers, --heads, --kv-heads,
# --ffn, --ctx, --vocab, --batch) mean the same on both sides (bench_train's --preset does not
# exist in pytorch_ref.py)
args=("$@")
run_kiln() { target/release/bench_train ${args[@]+"${args[@]}"} --dtype "$DTYPE" | tail -1; }
run_torch() { (cd bench && ../"$VENV"/bin/python pytorch_ref.py ${args[@]+"${args[@]}"} --dtype "$DTYPE" | tail -1); }
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
ratios=()
for i in $(seq 1 "$PAIRS"); do
  if (( i % 2 == 1 )); then k=$(run_kiln); t=$(run_torch); else t=$(run_torch); k=$(run_kiln); fi
  echo "kiln    $k"
  echo "pytorch $t"
  r=$(python3 - "$k" "$t" <<'PY'
import json, sys
k, t = json.loads(sys.argv[1]), json.loads(sys.argv[2])
keys = ["arch", "d_model", "layers", "heads", "kv_heads", "ffn", "ctx", "vocab", "params",
        "batch", "dtype"]
diff = [f"{key}: kiln {k.get(key)} pytorch {t.get(key)}" for key in keys if k.get(key) != t.get(key)]
if diff:
    sys.exit("kiln and pytorch_ref.py train different models: " + "; ".join(diff))
print(k["tokens_per_s"] / t["tokens_per_s"])
PY
)
  ratios+=("$r")
  echo "pair $i: kiln / pytorch = $r"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 -c 'import statistics,sys; r=[float(x) for x in sys.argv[1:]]; print(f"median kiln / pytorch tokens/s over {len(r)} pairs: {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")' "${ratios[@]}"
