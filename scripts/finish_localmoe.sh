#!/usr/bin/env bash
# Finish localmoe (issue 36) once its training run has written <cache>/localmoe/localmoe-f16.pt: export and quantize,
# then the routing measurements of both stand-ins on the held-out texts with and without their near-duplicates
# (scripts/locality_eval.py, into eval/routing-localmoe/locality.jsonl), then the warm re-test of finding 1b on both
# (docs/study-verdicts.md, "Warm starts"; eval/study-warm/<model>). Each step is skipped when its output exists, so an
# interrupted run goes on where it stopped. Training command and cost: models/localmoe.md.
#
#   scripts/finish_localmoe.sh [CHUNKS]      (locality_eval's chunks per text, spread over it; default 128)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
chunks="${1:-128}"
cache="${MOE_SUBST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-subst}"
work="$cache/localmoe"
py=.venv/bin/python
harness=.venv/bin/harness
export LLAMA_ARG_REPACK=0  # this VM: stock llama.cpp's repack kernels die with SIGILL on Q8_0 (models/studymoe-notes.md)

[ -f "$work/localmoe-f16.pt" ] || { echo "finish_localmoe: no finished training run in $work" >&2; exit 1; }
[ -f "$work/localmoe-q8_0.gguf" ] || "$py" scripts/train_moe.py --shape localmoe --stage export --work "$work" \
    --out "$work/localmoe-f16.gguf" --quantize q8_0
cp "$work/localmoe-q8_0.gguf" models/localmoe-q8_0.gguf
cp "$work/localmoe-f16.trainlog.jsonl" models/localmoe-trainlog.jsonl

out=eval/routing-localmoe/locality.jsonl
mkdir -p eval/routing-localmoe
for model in studymoe localmoe; do
    for text in heldout heldout-nodup heldout-docs heldout-docs-nodup; do
        label="$model $text"
        grep -qF "\"label\": \"$label\"" "$out" 2>/dev/null && continue
        "$py" scripts/locality_eval.py --gguf "models/$model-q8_0.gguf" --work "$cache/studymoe" \
            --text "eval/data/$text.txt" --chunks "$chunks" --label "$label" --out "$out"
    done
done

for model in studymoe localmoe; do
    "$harness" sweep --model "models/$model-q8_0.gguf" --rules fetch-all,threshold,substitute-all --taus 0.15 \
        --admits off --evicts lfu --residency 25 --chunks 0 --threads 2 --out "eval/study-warm/$model"
done
