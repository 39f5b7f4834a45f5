#!/usr/bin/env bash
# Compiles every kiln CUDA kernel source (all in kiln-kernels, crates/kernels/src/cuda/) to
# machine code for sm_${CUDA_COMPUTE_CAP:-90} with nvcc and ptxas, on any machine with CUDA's
# compiler (no GPU needed). kiln-kernels' build script does the same with the cuda feature for
# the kernels it embeds; this names each file and its result.
set -euo pipefail
cd "$(dirname "$0")/.."
cap="${CUDA_COMPUTE_CAP:-90}"
inc=()
[ -n "${CUDA_ROOT:-}" ] && inc=(-I "$CUDA_ROOT/include")
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
n=0
for cu in $(git ls-files '*.cu'); do
  base="$tmp/$(basename "$cu" .cu)"
  nvcc --ptx -O3 -std=c++17 -arch="compute_$cap" "${inc[@]}" -o "$base.ptx" "$cu"
  ptxas -arch="sm_$cap" -o "$base.cubin" "$base.ptx"
  kernels=$(grep -c '^\.visible \.entry' "$base.ptx" || true)
  printf '%s: %s kernels, sm_%s cubin %s bytes\n' "$cu" "$kernels" "$cap" "$(stat -c %s "$base.cubin")"
  n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "no .cu files found" >&2; exit 1; }
echo "$n kernel sources compile for sm_$cap"
