#!/usr/bin/env bash
# The GPU figures (GPT-2 124M and ResNet-50 side by side, checkpoint stall, restart split) and the
# CUDA tests, in parts that each fit one 10-minute command on a lent GPU machine.
#
#   bash benchmarks/gpu_session.sh PART [OUTDIR]
#
# PART: gpt2-eager | gpt2-compiled | stall-restart | resnet50 | tests-lm | tests
#
# Run from the repository root with the machine's own python3 and torch: ddpkit is imported from
# the checkout (PYTHONPATH), nothing is installed. Raw output goes to OUTDIR (default: $OUT if set,
# else benchmarks/data/gpu-<date>): a .txt per part (the printed tables, with the load average and the
# GPU, driver, torch version and date) and a .json of every measurement. Estimated times on an H200
# (GPT-2 steps of about 0.15 s at batch 64; each compiled arm compiles again, from Inductor's warm cache
# after the first): gpt2-eager ~3 min, gpt2-compiled ~5, stall-restart ~6, resnet50 ~6, tests-lm ~3,
# tests ~7. In order of importance: gpt2-eager, gpt2-compiled, stall-restart, resnet50, tests-lm.
set -euo pipefail
parts="gpt2-eager|gpt2-compiled|stall-restart|resnet50|tests-lm|tests"
part=${1:?"usage: bash benchmarks/gpu_session.sh $parts [OUTDIR]"}
out=${2:-${OUT:-benchmarks/data/gpu-$(date -u +%F)}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import torch; print('torch', torch.__version__)"
} >"$out/machine-$part.txt" 2>&1 || true

case "$part" in
  gpt2-eager|gpt2-compiled)  # hand-written vs ddpkit, 2 alternated rounds of 30 s per arm: 60 s measured per arm
    "$py" -m benchmarks.gpu_bound --device cuda --workload gpt2 --mode "${part#gpt2-}" --rounds 2 --seconds 30 \
      --json "$out/$part.json" 2>&1 | tee "$out/$part.txt" ;;
  stall-restart)  # sync vs checkpoint.async on the GPT, then restart to first step after a SIGKILL
    "$py" -m benchmarks.gpu_bound --device cuda --workload gpt2 --stall --every 50 --rounds 2 --seconds 30 \
      --json "$out/stall.json" 2>&1 | tee "$out/stall.txt"
    "$py" -m benchmarks.restart --device cuda --preset gpt2 --rounds 3 --preload torch._dynamo \
      --json "$out/restart.json" 2>&1 | tee "$out/restart.txt" ;;
  resnet50)
    "$py" -m benchmarks.gpu_bound --device cuda --workload resnet50 --mode both --rounds 2 --seconds 20 \
      --batch-size 256 --json "$out/resnet50.json" 2>&1 | tee "$out/resnet50.txt" ;;
  tests-lm)  # the cases added since the last GPU run: the language model, token ids, async staging, data on the GPU
    "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py \
      -k "language_model or token_id or async_save or already_on_the_gpu" 2>&1 | tee "$out/tests-lm.txt" ;;
  tests)
    "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests.txt" ;;
  *)
    echo "gpu_session.sh: unknown part '$part' ($parts)" >&2; exit 2 ;;
esac
