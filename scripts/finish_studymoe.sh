#!/usr/bin/env bash
# Finish studymoe (issue 22) from a constant-lr checkpoint: a decay branch, then export, checks and measurements,
# and the model card. Every step writes its own files and is skipped when they exist, so an interrupted run goes on
# where it stopped (the training step resumes from the branch's checkpoint).
#
#   scripts/finish_studymoe.sh DECAY_STEPS [THREADS]
#
# The branch starts from the constant-lr run's newest checkpoint (<cache>/studymoe/ckpt.pt; stop that run first:
# SIGTERM makes it checkpoint at a step boundary) and lives in <cache>/studymoe-decay-<S>, S its step; the constant-lr
# run can go on later from its own folder. Commands and costs: models/studymoe-notes.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
decay="${1:?usage: scripts/finish_studymoe.sh DECAY_STEPS [THREADS]}"
threads="${2:-2}"
cache="${MOE_SUBST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-subst}"
main="$cache/studymoe"
py=.venv/bin/python
harness=.venv/bin/harness
export LLAMA_ARG_REPACK=0  # this VM: stock llama.cpp's repack kernels die with SIGILL on Q8_0 (models/studymoe-notes.md)

[ -f "$main/ckpt.pt" ] || { echo "finish_studymoe: no checkpoint at $main/ckpt.pt" >&2; exit 1; }
step=$("$py" -c "import sys, torch; print(torch.load(sys.argv[1], weights_only=False, mmap=True)['step'])" "$main/ckpt.pt")
branch="${FINISH_BRANCH:-$cache/studymoe-decay-$step}"
if [ ! -d "$branch" ]; then
    echo "finish_studymoe: branching at step $step into $branch ($decay decay steps)"
    mkdir -p "$branch.tmp"
    cp "$main/ckpt.pt" "$main/config.json" "$main/studymoe-f16.trainlog.jsonl" "$branch.tmp/"
    for f in tokenizer.json train_tokens.npy corpus_stats.json train.jsonl; do ln -s "$main/$f" "$branch.tmp/$f"; done
    mv "$branch.tmp" "$branch"
fi
stable=$("$py" -c "import json, sys; c = json.load(open(sys.argv[1])); print(c['decay_start'])" "$branch/config.json")
[ -f "$branch/ckpt-stable-$stable.pt" ] || stable=$step  # the branch's first run: decay from the checkpoint's step

f16="$branch/studymoe-f16.gguf"
q8="$branch/studymoe-q8_0.gguf"
if [ ! -f "$branch/studymoe-f16.pt" ]; then
    "$py" scripts/train_moe.py --shape studymoe --stage train --work "$branch" --resume --threads "$threads" \
        --stable-steps "$stable" --decay-steps "$decay" --checkpoint-every 300
    [ -f "$branch/studymoe-f16.pt" ] || { echo "finish_studymoe: the decay stopped early; run again to go on" >&2; exit 1; }
fi
[ -f "$q8" ] || "$py" scripts/train_moe.py --shape studymoe --stage export --work "$branch" --out "$f16" --quantize q8_0
cp "$q8" models/studymoe-q8_0.gguf
[ -f "$branch/studymoe-f16.eval.json" ] || "$py" scripts/train_moe.py --shape studymoe --stage eval --work "$branch" \
    --out "$f16" --threads "$threads"
for t in heldout heldout-docs; do
    [ -f "eval/bpb/studymoe-$t/bpb.json" ] || "$harness" bpb models/studymoe-q8_0.gguf --text "eval/data/$t.txt" \
        --threads "$threads" --out "eval/bpb/studymoe-$t"
done
[ -x build/llama_logits ] || scripts/build_llama_logits.sh
[ -f models/studymoe-export-check.json ] || "$py" scripts/check_export.py --model "$f16" --work "$branch" \
    --out models/studymoe-export-check.json --quantized models/studymoe-q8_0.gguf
"$harness" generate --model models/studymoe-q8_0.gguf --prompts eval/data/gen-prompts-domains.jsonl \
    --policies fetch-all --threads "$threads" --out eval/gen-studymoe
trace="results/routing-studymoe/router.trace"
if [ ! -s "$trace" ]; then
    mkdir -p results/routing-studymoe
    vendor/llama.cpp-patched/build-cpu/bin/llama-perplexity -m models/studymoe-q8_0.gguf -f eval/data/heldout.txt \
        -c 512 -b 512 -t "$threads" --moe-cache "mode=emulate,policy=fetch-all,slots=25%,trace=$trace.tmp" \
        > results/routing-studymoe/perplexity.log 2>&1
    mv "$trace.tmp" "$trace"
fi
mkdir -p eval/routing-studymoe
"$harness" routing --trace "$trace" > eval/routing-studymoe/report.md
"$py" scripts/write_model_card.py --shape studymoe --work "$branch"
echo "finish_studymoe: done ($branch)"
