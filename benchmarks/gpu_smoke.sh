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

python - "$WORK" <<'PY'
import json, pathlib, sys

TOKENS_PER_ITER = 16 * 1024  # global batch x sequence length, as above
work = pathlib.Path(sys.argv[1])
rates = {}
for backend in ("te", "local"):
    records = [json.loads(line) for line in (work / f"{backend}.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    # Leave out the first quarter of the steps (kernel selection, allocator warm-up).
    timed = steps[len(steps) // 4:] or steps
    rates[backend] = TOKENS_PER_ITER * len(timed) / sum(r["step_time_s"] for r in timed)
    print(f"{backend:5s}: {rates[backend]:10.0f} tokens/s "
          f"(final loss {steps[-1]['lm_loss']:.4f})")
print(f"te / local: {rates['te'] / rates['local']:.2f}x")
PY

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
  python - "$WORK" <<'PY'
import json, pathlib, sys

work = pathlib.Path(sys.argv[1])
TOKENS_PER_ITER = 16 * 1024
for backend in ("local", "te"):
    base = None
    for schedule in ("1f1b", "zb-h1", "zbv"):
        records = [json.loads(line) for line in
                   (work / f"pp-{schedule}-{backend}.jsonl").read_text().splitlines()]
        steps = [r for r in records if "step_time_s" in r]
        timed = steps[len(steps) // 4:] or steps
        rate = TOKENS_PER_ITER * len(timed) / sum(r["step_time_s"] for r in timed)
        losses = [r["lm_loss"] for r in steps]
        base = base or losses
        drift = max(abs(a - b) / abs(b) for a, b in zip(losses, base))
        print(f"{backend:5s} {schedule:6s}: {rate:10.0f} tokens/s, final loss {losses[-1]:.4f}, "
              f"max relative loss difference to 1f1b {drift:.2e}")
PY
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
  python - "$WORK" <<'PY'
import json, pathlib, sys

work = pathlib.Path(sys.argv[1])
TOKENS_PER_ITER = 16 * 1024
base = None
for wrapper in ("ddp", "fsdp2"):
    records = [json.loads(line) for line in
               (work / f"dp-{wrapper}.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    timed = steps[len(steps) // 4:] or steps
    rate = TOKENS_PER_ITER * len(timed) / sum(r["step_time_s"] for r in timed)
    losses = [r["lm_loss"] for r in steps]
    base = base or losses
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses, base))
    print(f"{wrapper:5s}: {rate:10.0f} tokens/s, final loss {losses[-1]:.4f}, "
          f"max relative loss difference to ddp {drift:.2e}")
PY
  echo "== two nodes and an elastic restart over NCCL"
  python benchmarks/nodes_smoke.py "$ITERS"
else
  echo "(one GPU: the pp 2 zero-bubble, dp 2 fsdp2, two-node and elastic runs need two)"
fi
