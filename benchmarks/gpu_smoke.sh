#!/usr/bin/env bash
# GPU smoke test of the `te` layer backend: a few bf16 iterations on one GPU with
# `--layer-backend te` and, for comparison, `--layer-backend local`; prints tokens/s of each.
# Needs CUDA and transformer-engine (pip install 'transformer-engine[pytorch]'). Not runnable on
# CPU-only machines. With two GPUs or more it also runs the zero-bubble schedules at pp 2 over
# NCCL (1f1b, zb-h1, zbv, each with the local and the te backend: the te linears defer their
# weight gradients to W through transformer-engine's delayed wgrad where the installed TE has
# it, else compute them at I and the run's note says so) and compares their losses, and fsdp2
# against ddp at dp 2 (tokens/s and losses), and benchmarks/nodes_smoke.py over NCCL: two
# launchers as two nodes (one GPU each) and an elastic restart after a SIGKILLed rank.
# Usage: benchmarks/gpu_smoke.sh [ITERS]
set -euo pipefail

ITERS="${1:-20}"
WORK="$(mktemp -d)"
HERE="$(cd "$(dirname "$0")" && pwd)"
trap 'rm -rf "$WORK"' EXIT

MODEL=(--data mock --vocab-size 32000 --num-layers 4 --hidden-size 1024
       --num-attention-heads 16 --num-query-groups 4 --swiglu --normalization RMSNorm
       --position-embedding-type rope --disable-bias-linear --seq-length 1024
       --micro-batch-size 4 --global-batch-size 16 --train-iters "$ITERS" --lr 1e-4
       --min-lr 1e-5 --lr-warmup-iters 2 --eval-interval 0 --log-interval 5 --no-progress
       --bf16)

for backend in te local; do
  echo "== --layer-backend $backend --bf16, $ITERS iterations"
  plugtron train "${MODEL[@]}" --layer-backend "$backend" \
    --metrics-file "$WORK/$backend.jsonl"
done

# 16 x 1024 tokens per iteration: global batch x sequence length, as above.
python "$HERE/metrics_rates.py" $((16 * 1024)) "$WORK/te.jsonl" "$WORK/local.jsonl"

GPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
if [ "$GPUS" -ge 2 ]; then
  PIPE=(--data mock --vocab-size 32000 --num-layers 8 --hidden-size 1024
        --num-attention-heads 16 --seq-length 1024 --micro-batch-size 2 --global-batch-size 16
        --train-iters "$ITERS" --lr 1e-4 --eval-interval 0 --log-interval 5 --no-progress
        --bf16 --pp 2 --nproc-per-node 2)
  for backend in local te; do
    for schedule in 1f1b zb-h1 zbv; do
      echo "== pp 2, --schedule $schedule --layer-backend $backend, $ITERS iterations"
      plugtron train "${PIPE[@]}" --schedule "$schedule" --layer-backend "$backend" \
        --metrics-file "$WORK/pp-$schedule-$backend.jsonl"
    done
  done
  for backend in local te; do
    python "$HERE/metrics_rates.py" $((16 * 1024)) "$WORK"/pp-{1f1b,zb-h1,zbv}-"$backend".jsonl
  done
  # fsdp2 against ddp over NCCL: the same code path as on gloo, the devices' own collectives.
  DP=(--data mock --vocab-size 32000 --num-layers 8 --hidden-size 1024
      --num-attention-heads 16 --seq-length 1024 --micro-batch-size 2 --global-batch-size 16
      --train-iters "$ITERS" --lr 1e-4 --eval-interval 0 --log-interval 5 --no-progress
      --bf16 --nproc-per-node 2)
  for wrapper in ddp fsdp2; do
    echo "== dp 2, --data-parallel $wrapper, $ITERS iterations"
    plugtron train "${DP[@]}" --data-parallel "$wrapper" \
      --metrics-file "$WORK/dp-$wrapper.jsonl"
  done
  python "$HERE/metrics_rates.py" $((16 * 1024)) "$WORK"/dp-{ddp,fsdp2}.jsonl
  echo "== two nodes and an elastic restart over NCCL"
  python "$HERE/nodes_smoke.py" "$ITERS"
else
  echo "(one GPU: the pp 2 zero-bubble, dp 2 fsdp2, two-node and elastic runs need two)"
fi
