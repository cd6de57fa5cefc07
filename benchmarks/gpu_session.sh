#!/usr/bin/env bash
# The GPU figures, in parts that each fit one command on a lent GPU machine: this round's Llama 3.2 1B modes in one
# run of at most 8 minutes (part llama), GPT-2 124M and ResNet-50 beside a hand-written loop, the checkpoint stall and
# restart split, and the CUDA tests.
#
#   bash benchmarks/gpu_session.sh llama "$OUT"          # ~7.3 min, at most 7 min 50 s, every mode time-boxed
#   bash benchmarks/gpu_session.sh PART [OUTDIR]
#   DRY_RUN=1 bash benchmarks/gpu_session.sh llama       # the plan: each mode's limit, expected time, command, files
#   SMOKE=1 PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh llama /tmp/gpu-smoke   # the same, CPU, tiny shapes
#
# PART: llama | llama-eager | llama-generate | llama-compiled | llama-documents
#       | gpt2-eager | gpt2-compiled | stall-restart | resnet50 | tests-lm | tests
#
# Run from the repository root with the machine's own python3 and torch: ddpkit is imported from the checkout
# (PYTHONPATH), nothing is installed. Raw output goes to OUTDIR (default: $OUT if set, else
# benchmarks/data/<date>/gpu-<gpu>, e.g. gpu-h200): a .txt per part or mode (the printed tables, with the load
# average and the GPU, driver, torch version and date), a .json of every measurement (rewritten after every arm or
# round, so a mode stopped by its limit keeps what it measured) and machine-<part>.txt. Copy OUTDIR's files to
# benchmarks/data/<date>/gpu-<gpu>/ when they come back.
#
# llama: the Llama 3.2 1B shape (ddpkit's gpt with preset llama3.2-1b, random weights), batch 4 x 2,048 tokens,
# bf16 autocast, fused AdamW, in four modes run one after another, each under `timeout` at its own limit cut to what
# is left of GPU_SESSION_BUDGET_S (default 470 s, 5 s of it kept back for the last kill; a mode with under 30 s
# left is skipped and says so), so one hung mode cannot take the others' time. Expected on an H200 (estimates, not
# yet measured: a step of ~0.2 s, model builds of a few seconds, a cold compilation of ~1 min; batch 4 also fits
# an H100's 80 GB):
#   llama-eager      ~150 s  hand-written loop vs ddpkit, full fine-tune and LoRA r 16 all-linear, 2 x 5 s an arm
#   llama-generate    ~60 s  greedy generation, fp32+autocast (ddpkit generate's) and bf16 weights, batch 1 and 8,
#                            with and without the KV cache, 256 new tokens, 2 rounds
#   llama-compiled   ~140 s  llama-eager's full arms under torch.compile, 1 round of 6 s (the first compiles cold)
#   llama-documents   ~85 s  ddpkit's step with the document mask (FlexAttention, documents of ~512 tokens) vs causal,
#                            1 round of 5 s
# Files: llama-<mode>.txt and .json for each, llama-summary.txt (each mode's exit status and seconds),
# machine-llama.txt. Exit status: 0 when every mode finished cleanly, else 1 (the summary names which).
#
# The other parts' estimated times on an H200 (GPT-2 steps of about 0.15 s at batch 64; each compiled arm compiles
# again, from Inductor's warm cache after the first): gpt2-eager ~3 min, gpt2-compiled ~5, stall-restart ~6,
# resnet50 ~6, tests-lm ~3, tests ~7.
set -euo pipefail
parts="llama|llama-eager|llama-generate|llama-compiled|llama-documents"
parts+="|gpt2-eager|gpt2-compiled|stall-restart|resnet50|tests-lm|tests"
part=${1:?"usage: bash benchmarks/gpu_session.sh $parts [OUTDIR]"}
py=${PYTHON:-python3}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '[abhl][0-9]{2,3}s?' |
  head -1 | tr '[:upper:]' '[:lower:]' || true)
[[ -n ${SMOKE:-} ]] && gpu=cpu-smoke
out=${2:-${OUT:-benchmarks/data/$(date -u +%F)/gpu-${gpu:-gpu}}}
budget=${GPU_SESSION_BUDGET_S:-470}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Inductor's cache where it is by default, whatever TMPDIR each llama mode gets: one mode's compilations serve the next
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}

# name|expected s|limit s: the llama part's modes in the order they run, the most important first
llama_modes=("llama-eager|150|200" "llama-generate|60|100" "llama-compiled|140|190" "llama-documents|85|130")

llama_command() {  # llama_command MODE: sets cmd to MODE's command (SMOKE: the same code path, CPU, tiny shapes)
  local bound=("$py" -m benchmarks.gpu_bound --workload llama1b --batch-size 4) smoke=()
  [[ -n ${SMOKE:-} ]] && smoke=(--device cpu --tiny --rounds 1) || smoke=(--device cuda)
  case "$1" in
    llama-eager)
      cmd=("${bound[@]}" --mode eager --variants full,lora --rounds 2 --seconds 5 --warmup 3) ;;
    llama-generate)
      cmd=("$py" -m benchmarks.gpu_generate --weights fp32+autocast,bf16 --batches 1,8 --rounds 2) ;;
    llama-compiled)
      cmd=("${bound[@]}" --mode compiled --rounds 1 --seconds 6 --warmup 4) ;;
    llama-documents)
      cmd=("${bound[@]}" --mode eager --variants full,documents --sides ddpkit --rounds 1 --seconds 5 --warmup 3) ;;
    *) echo "gpu_session.sh: unknown llama mode '$1'" >&2; exit 2 ;;
  esac
  # the smoke's settings last: argparse keeps the last of a repeated option
  cmd+=("${smoke[@]}" --json "$out/$1.json")
  [[ -n ${SMOKE:-} && $1 != llama-generate ]] && cmd+=(--seconds 0.3 --warmup 2)
  return 0
}

plan() {  # what each mode runs and writes, before anything runs
  local entry name expected limit
  echo "[gpu_session] $part: budget ${budget} s in all, raw files in $out"
  for entry in "$@"; do
    IFS='|' read -r name expected limit <<<"$entry"
    llama_command "$name"
    echo "[gpu_session]   $name: expected ~${expected} s, limit ${limit} s -> $out/$name.txt, $out/$name.json"
    echo "[gpu_session]     ${cmd[*]}"
  done
}

run_mode() {  # run_mode NAME EXPECTED LIMIT: NAME's command under min(LIMIT, what is left of the budget)
  local name=$1 expected=$2 limit=$3 left rc started tmp
  # 5 s kept back: the kill, the GPU's memory given back, the summary
  left=$((budget - SECONDS - 5))
  ((limit > left)) && limit=$left
  if ((limit < 30)); then
    echo "[gpu_session] $name: skipped, $((left > 0 ? left : 0)) s of the $budget s budget left" | tee "$out/$name.txt"
    echo "$name skipped 0 s (budget)" >>"$out/llama-summary.txt"
    failed=1
    return 0
  fi
  llama_command "$name"
  echo "[gpu_session] $name: expected ~${expected} s, limit ${limit} s -> $out/$name.txt, $out/$name.json"
  started=$SECONDS
  # the mode's temporary files (the Trainer's model.pt, 5 GB at 1B) in a folder of its own, removed even after a kill
  tmp=$(mktemp -d)
  set +e
  # SIGKILL at the limit, no grace: every arm's figures are already in the .json (a SIGTERM would have the Trainer
  # stop at an agreed step and write a 15 GB checkpoint first)
  TMPDIR=$tmp timeout --signal=KILL "$limit" "${cmd[@]}" 2>&1 | tee "$out/$name.txt"
  rc=${PIPESTATUS[0]}
  set -e
  rm -rf "$tmp"
  status="failed (rc $rc)"
  ((rc == 0)) && status=ok
  # 137 is also the kernel's OOM killer: the limit was reached only if the time says so
  ((rc == 137 && SECONDS - started >= limit)) && status="stopped at its $limit s limit (rc 137)"
  ((rc == 0)) || failed=1
  echo "[gpu_session] $name: $status after $((SECONDS - started)) s"
  echo "$name $status $((SECONDS - started)) s" >>"$out/llama-summary.txt"
}

llama() {  # run_mode for each of the given modes, then the summary
  failed=0
  : >"$out/llama-summary.txt"
  for entry in "$@"; do
    IFS='|' read -r name expected limit <<<"$entry"
    run_mode "$name" "$expected" "$limit"
  done
  echo "[gpu_session] done in ${SECONDS} s; $out:"
  cat "$out/llama-summary.txt"
  ls -l "$out"
  return "$failed"
}

case "$part" in
  llama) modes=("${llama_modes[@]}") ;;
  llama-*)
    modes=()
    for entry in "${llama_modes[@]}"; do [[ ${entry%%|*} == "$part" ]] && modes=("$entry"); done
    ((${#modes[@]})) || { echo "gpu_session.sh: unknown part '$part' ($parts)" >&2; exit 2; } ;;
esac
if [[ $part == llama* ]]; then
  plan "${modes[@]}"
  [[ -n ${DRY_RUN:-} ]] && exit 0
fi

mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$py" -c "import sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'python', sys.version)"
  echo "host cores $(nproc), load average $(cut -d' ' -f1-3 /proc/loadavg), $(date -u +%FT%TZ)"
} >"$out/machine-$part.txt" 2>&1 || true

case "$part" in
  llama*)
    llama "${modes[@]}" ;;
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
