#!/usr/bin/env bash
# The one-GPU check, prepared to run with no editing on a machine with one CUDA GPU (about 8
# minutes): every test that needs CUDA (the te backend, te's split backward, MoE's CUDA paths,
# the fused output loss),
# a tiny model's losses on CUDA against CPU, and the bf16 MFU of a ~1B GPT with the local and te
# backends against the GPU's peak. Prints a markdown table for benchmarks/RESULTS.md; exit 1 if
# any part failed. transformer-engine is optional: without it the te rows say so.
# Usage (repository root, after `make install`): benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
failed=0
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)' || {
  echo "gpu_check: no CUDA device here" >&2; exit 2; }
echo "## One-GPU check ($(date +%F), $("$PY" -c 'import torch; print(torch.cuda.get_device_name())'), torch $("$PY" -c 'import torch; print(torch.__version__)'))"
echo
echo "| part | result | verdict |"
echo "|---|---|---|"
# 1. The tests that need CUDA (their CPU cases run too; -rs names any that still skipped).
out="$(OMP_NUM_THREADS=4 timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/plugins/layer_backends/test_te_backend.py \
  tests/plugins/layer_backends/test_te_split_backward.py \
  tests/distributed/test_te_split_backward.py moe_plugin/tests/test_moe_plugin.py \
  tests/core/blocks/test_linear_cross_entropy.py 2>&1)"
rc=$?
summary="$(printf '%s\n' "$out" | tail -1)"
skips="$(printf '%s\n' "$out" | grep -c '^SKIPPED' || true)"
echo "| tests needing CUDA | $summary ($skips skip lines) | $([ $rc -eq 0 ] && echo ok || echo FAILED) |"
[ $rc -eq 0 ] || { failed=1; printf '%s\n' "$out" | tail -40 >&2; }
# 2. Losses on CUDA against CPU.
timeout 120 "$PY" benchmarks/gpu_check.py losses || failed=1
# 3. MFU of a ~1B GPT, bf16, each backend.
for backend in local te; do
  timeout 150 "$PY" benchmarks/gpu_check.py mfu "$backend" || failed=1
done
exit $failed
