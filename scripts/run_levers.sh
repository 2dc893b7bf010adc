#!/usr/bin/env bash
# Issue 36's lever screening: short fine-tunes of studymoe (from the committed Q8_0 weights, fresh optimiser) with
# one routing lever each, then scripts/locality_eval.py on held-out text. Same schedule for every lever: STEPS
# steps (lr LR, 30 warmup, the last fifth a linear decay to 0.1x), seed 1234, so that only the lever differs.
# Each run has its own work folder (checkpoints: resumable, ./scripts/run_levers.sh again goes on);
# the results are appended to eval/locality-levers/levers.jsonl.
#   scripts/run_levers.sh [LEVER...]      (default: all, in the order below)
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
LR=${LR:-1e-3}
CHUNKS=${CHUNKS:-64}
BASE=${MOE_SUBST_CACHE:-$HOME/.cache/moe-subst}
SRC=$BASE/studymoe
INIT=2802   # the committed model's step
declare -A LEVER=(
  [control]=""
  [loc0.1-w64]="--locality-coef 0.1 --locality-window 64 --capacity-factor 4"
  [global]="--aux-scope global --aux-ema 0.99 --capacity-factor 4"
  [loc0.3-w32-global]="--locality-coef 0.3 --locality-window 32 --aux-scope global --capacity-factor 4"
  [loc1-w32-global]="--locality-coef 1.0 --locality-window 32 --aux-scope global --capacity-factor 4"
  [loc1-w32-global-aux0.1]="--locality-coef 1.0 --locality-window 32 --aux-scope global --aux-coef 0.1 --capacity-factor 4"
  [cap4]="--capacity-factor 4"
)
ORDER=("$@")
[ ${#ORDER[@]} -eq 0 ] && ORDER=(loc0.1-w64 loc1-w32-global control global)
decay=$((STEPS / 5))
for name in "${ORDER[@]}"; do
  [ -n "${LEVER[$name]+x}" ] || { echo "run_levers.sh: unknown lever $name (${!LEVER[*]})" >&2; exit 2; }
  work=$BASE/lever-$name
  mkdir -p "$work"
  for f in tokenizer.json train_tokens.npy; do ln -sf "$SRC/$f" "$work/$f"; done
  if [ ! -f "$work/studymoe-f16.pt" ]; then
    # shellcheck disable=SC2086
    .venv/bin/python scripts/train_moe.py --shape studymoe --stage train --work "$work" --out "$work/studymoe-f16.gguf" \
      --init-gguf models/studymoe-q8_0.gguf --resume --lr "$LR" --warmup 30 \
      --stable-steps $((INIT + STEPS - decay)) --decay-steps "$decay" --checkpoint-every 300 ${LEVER[$name]} \
      > "$work/train.log" 2>&1
  fi
  grep -q "trained " "$work/train.log" || { echo "run_levers.sh: $name stopped early ($work/train.log)"; exit 1; }
  .venv/bin/python scripts/locality_eval.py --ckpt "$work/ckpt.pt" --work "$work" --chunks "$CHUNKS" --label "$name" \
    --out eval/locality-levers/levers.jsonl
done
