#!/usr/bin/env bash
# GPU checks of kiln, in two halves:
#
#   scripts/gpu_check.sh build   on a CPU machine with cargo and network: installs CUDA's
#                                compiler and libraries from PyPI, builds the test and example
#                                binaries with the `cuda` feature (linking against a stub
#                                libcuda.so, since the driver library is on no registry) and
#                                bundles them in gpu_bundle/ (under 64 MiB).
#   scripts/gpu_check.sh run     on the GPU machine (no cargo, no network; NVIDIA driver, and a
#                                Python whose nvidia-* packages carry CUDA's libraries): the op
#                                tests against the CPU (fused ops, AdamW, tensor-parallel
#                                ops on 2 thread ranks), a 20-step train_gpt on CUDA against the
#                                same 20 steps on the CPU, and throughput with MFU beside
#                                PyTorch (bench/torch_gpt.py) on the same model.
#
# Environment: KILN_CUDA_PY (where the PyPI packages go, default ~/.cache/kiln-cu13),
# CUDA_COMPUTE_CAP (default 90: H100/H200).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
cap="${CUDA_COMPUTE_CAP:-90}"
bundle=gpu_bundle

build() {
  local py="${KILN_CUDA_PY:-$HOME/.cache/kiln-cu13}"
  # the compiler (as .ci/run installs it) and, in a folder of their own, the libraries a
  # binary links to (pip --target does not merge into an existing nvidia/ folder)
  if [ ! -x "$py/nvidia/cu13/bin/nvcc" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$py" \
      "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.*" "nvidia-cuda-crt==13.0.*" \
      "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*"
  fi
  local libs="$py-libs"
  if [ ! -e "$libs/nvidia/cu13/lib/libcublas.so.13" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$libs" \
      "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-nvrtc==13.0.*" "nvidia-cublas==13.0.*" \
      "nvidia-curand==10.4.0.*"
  fi
  # NCCL in a folder of its own too (train_gpt built with the nccl feature links it)
  local nccl="$py-nccl"
  if [ -z "$(find "$nccl" -name 'libnccl.so*' 2>/dev/null | head -1)" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --target "$nccl" "nvidia-nccl-cu13"
  fi
  export CUDA_ROOT="$py/nvidia/cu13" CUDA_COMPUTE_CAP="$cap"
  export PATH="$CUDA_ROOT/bin:$PATH"
  # link folder: unversioned names of the PyPI libraries, and a stub libcuda.so.1 with one
  # empty function per driver entry point of cuda.h (the real driver is loaded at run time)
  local link="$PWD/target/cuda-link"
  mkdir -p "$link"
  for lib in "$CUDA_ROOT"/lib/lib*.so.* "$libs"/nvidia/*/lib/lib*.so.* \
      $(find "$nccl" -name 'libnccl.so.*'); do
    local name
    name="$(basename "$lib")"
    ln -sf "$lib" "$link/${name%%.so.*}.so"
  done
  if [ ! -e "$link/libcuda.so" ]; then
    gcc -E -P "$CUDA_ROOT/include/cuda.h" -I "$CUDA_ROOT/include" |
      grep -oE '\bCUresult +cu[A-Za-z0-9_]+ *\(' | sed -E 's/CUresult +//; s/ *\(//' |
      sort -u | awk '{ printf "int %s(void) { return 0; }\n", $1 }' >"$link/cuda_stub.c"
    echo "stub libcuda: $(wc -l <"$link/cuda_stub.c") driver entry points"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda_stub.c"
  fi
  export RUSTFLAGS="${RUSTFLAGS:-} -L $link"
  export CARGO_TARGET_DIR=target/cuda-bin
  # train_gpt with NCCL too (candle links CUDA's libraries, libnccl included, dynamically)
  cargo build --release --features cuda,nccl --example train_gpt
  rm -rf "$bundle" && mkdir -p "$bundle"
  cp "$CARGO_TARGET_DIR/release/examples/train_gpt" "$bundle/"
  # the GPU tests: (package, test target)
  for t in kiln-kernels:cuda kiln-model:cuda_model kiln-parallel:cuda_tp \
      kiln-parallel:cuda_resident; do
    local pkg="${t%%:*}" name="${t##*:}" exe
    exe=$(cargo test --release --features cuda -p "$pkg" --test "$name" --no-run \
      --message-format=json 2>/dev/null | NAME="$name" python3 -c 'import json, os, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == os.environ["NAME"]:
        print(m["executable"])')
    cp "$exe" "$bundle/$name"
    strip "$bundle/$name"
  done
  # NCCL: the backend's test and the bandwidth bench (feature nccl alone: cudarc loads libcuda
  # and libnccl at run time, so these link without them)
  local nccl_test
  nccl_test=$(cargo test --release -p kiln-comm --features nccl --test nccl --no-run \
    --message-format=json 2>/dev/null | python3 -c 'import json, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl":
        print(m["executable"])')
  cp "$nccl_test" "$bundle/nccl"
  cargo build --release --features nccl -p kiln-bench --bin bench_comm
  cp "$CARGO_TARGET_DIR/release/bench_comm" "$bundle/"
  strip "$bundle/nccl" "$bundle/bench_comm"
  strip "$bundle/train_gpt"
  cp bench/torch_gpt.py "$bundle/"
  du -sh "$bundle"
  # candle's PTX makes each binary about 50 MB; xz shrinks them about 7 times
  tar -cJf "$bundle.tar.xz" "$bundle"
  local bytes
  bytes=$(stat -c %s "$bundle.tar.xz")
  [ "$bytes" -lt $((64 * 1024 * 1024)) ] || { echo "$bundle.tar.xz is $bytes bytes, over 64 MiB" >&2; exit 1; }
  echo "carry $bundle.tar.xz ($bytes bytes) to the GPU machine and run: scripts/gpu_check.sh run"
}

run() {
  if [ ! -d "$bundle" ] && [ -f "$bundle.tar.xz" ]; then
    python3 -c 'import tarfile; tarfile.open("gpu_bundle.tar.xz").extractall()'
  fi
  [ -d "$bundle" ] || { echo "no $bundle/: run 'scripts/gpu_check.sh build' first" >&2; exit 1; }
  # CUDA's libraries from the Python packages (torch's nvidia-* wheels)
  local libs
  libs=$(python3 - <<'EOF'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = set()
for r in roots:
    for lib in glob.glob(os.path.join(r, "nvidia", "**", "lib", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(lib))
print(":".join(sorted(dirs)))
EOF
)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "== kiln-kernels on CUDA against the CPU: the fused ops, the fused causal attention,"
  echo "   AdamW (bitwise)"
  "$bundle/cuda" --nocapture --test-threads 1
  echo "== the tiny GPT's loss and gradients on CUDA against the CPU"
  "$bundle/cuda_model" --nocapture --test-threads 1
  echo "== the device-resident step against the CPU step, bitwise (GPU <-> CPU state too)"
  "$bundle/cuda_resident" --nocapture
  echo "== tensor-parallel ops on CUDA (staged through the host) against the CPU, 2 thread ranks"
  "$bundle/cuda_tp" --nocapture --test-threads 1
  echo "== 20 steps of train_gpt (tiny preset, f32, one rank) on CUDA and on the CPU"
  # the tiny model at its context; a constant LR after warmup, so a 10-step run is the first
  # half of the 20-step one
  local common=(--preset tiny --ctx 64 --steps 20 --dp 1 --tp 1 --precision f32
    --optim.schedule.warmup_steps 5 --optim.schedule.decay constant
    --eval_every 0 --ckpt_every 0 --metrics.png off --metrics.tensorboard off)
  "$bundle/train_gpt" "${common[@]}" --device cpu --out runs/gpu_check_cpu | tail -5
  "$bundle/train_gpt" "${common[@]}" --device cuda --out runs/gpu_check_cuda | tail -5
  python3 - <<'EOF'
import json
def losses(d):
    rows = [json.loads(l) for l in open(f"runs/{d}/metrics.jsonl")]
    return [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
a, b = losses("gpu_check_cpu"), losses("gpu_check_cuda")
assert len(a) == len(b) == 20, (len(a), len(b))
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"20-step losses cpu {a[-1]:.6f} cuda {b[-1]:.6f}, worst relative difference {worst:.2e}")
# f32 on both; only the reduction order differs (cuBLAS, block-wide sums)
assert worst < 1e-3, f"CUDA and CPU losses differ by {worst:.2e} (tolerance 1e-3)"
EOF
  echo "== a checkpoint written on CUDA resumes on the CPU (10 + 10 steps against 20 on the CPU)"
  "$bundle/train_gpt" "${common[@]}" --steps 10 --ckpt_every 10 --device cuda \
    --out runs/gpu_check_resume | tail -2
  "$bundle/train_gpt" "${common[@]}" --ckpt_every 10 --resume --device cpu \
    --out runs/gpu_check_resume | tail -3
  python3 - <<'EOF'
import json
def losses(d):
    rows = [json.loads(l) for l in open(f"runs/{d}/metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))}
a, b = losses("gpu_check_cpu"), losses("gpu_check_resume")
worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in range(11, 21))
print(f"steps 11-20 resumed on the CPU from a CUDA checkpoint: worst relative difference {worst:.2e}")
assert worst < 1e-3, f"resumed run differs by {worst:.2e} (tolerance 1e-3)"
EOF
  echo "== NCCL: a world of one on the GPU (host and device collectives, split)"
  "$bundle/nccl" --nocapture
  echo "== NCCL: two processes sharing the GPU (distinct NCCL_HOSTID, P2P and shared memory off)"
  mkdir -p runs
  local pids=() r
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=29611 NCCL_HOSTID="kiln-check-$r" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
      timeout 300 "$bundle/bench_comm" --backend nccl --quick >"runs/nccl_rank$r.log" 2>&1 &
    pids+=($!)
  done
  local ok=1
  for r in 0 1; do wait "${pids[$r]}" || ok=0; done
  cat runs/nccl_rank0.log
  if [ "$ok" = 1 ]; then
    echo "two NCCL ranks on one GPU: worked"
  else
    echo "two NCCL ranks on one GPU: did not work (rank 1's output below)"
    tail -20 runs/nccl_rank1.log
  fi
  if [ "$ok" = 1 ]; then
    echo "== train_gpt dp=2 over NCCL (two processes on the GPU, device-resident) against dp=1"
    pids=()
    for r in 0 1; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29612 NCCL_HOSTID="kiln-check-$r" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
        timeout 600 "$bundle/train_gpt" "${common[@]}" --dp 2 --batch 2 --backend nccl \
        --device cuda --out runs/gpu_check_nccl_dp2 >"runs/nccl_train_rank$r.log" 2>&1 &
      pids+=($!)
    done
    for r in 0 1; do wait "${pids[$r]}" || { tail -20 "runs/nccl_train_rank$r.log"; exit 1; }; done
    tail -4 runs/nccl_train_rank0.log
    python3 - <<'EOF'
import json
def losses(d):
    rows = [json.loads(l) for l in open(f"runs/{d}/metrics.jsonl")]
    return [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
a, b = losses("gpu_check_cuda"), losses("gpu_check_nccl_dp2")
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"dp=2 over NCCL against dp=1 on CUDA, 20 steps: worst relative loss difference {worst:.2e}")
assert len(b) == 20 and worst < 1e-3, f"{len(b)} steps, {worst:.2e} (tolerance 1e-3)"
EOF
  fi
  echo "== throughput: gpt3_small and gpt3_medium, bf16, kiln beside PyTorch"
  for preset in gpt3_small gpt3_medium; do
    "$bundle/train_gpt" --preset "$preset" --steps 30 --dp 1 --tp 1 --precision bf16 \
      --recompute none --device cuda --ctx 1024 --batch 8 \
      --eval_every 0 --ckpt_every 0 --metrics.png off --metrics.tensorboard off \
      --metrics.peak_flops_per_s 989e12 --out "runs/gpu_bench_$preset" | tail -3
    python3 "$bundle/torch_gpt.py" --preset "$preset" --steps 30 --ctx 1024 --batch 8 || true
  done
}

case "$mode" in
  build) build ;;
  run) run ;;
  *) echo "usage: scripts/gpu_check.sh build|run" >&2; exit 2 ;;
esac
