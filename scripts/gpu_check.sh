#!/usr/bin/env bash
# GPU check of the expert cache engine (issue 4, item 8), for a machine with one NVIDIA GPU.
#
#   scripts/gpu_check.sh [--dry-run] [--offline] [--layers N] [--dtype q4_k_m|q4_0|q8_0] [--budget-pct P] [--reps R]
#                        [--cuda-arch A] [--out DIR]
#
# 1. builds (or reuses) the CUDA builds of llama-bench: ./build.sh --cuda --cuda-arch A (default 90, an
#    H100/H200) --targets "llama-bench llama-quantize" --share-ggml (one ggml for both trees); MOE_SUBST_PATCHED_BIN=/path/to/bin uses another patched build instead.
#    --offline (automatic when .gpu/trees.tar.xz exists and there is no .venv: the lent GPU machine, which
#    has no network): the trees come from the bundle that scripts/gpu_bundle.sh made (carry .gpu), the build
#    runs with ./build.sh --offline, and the harness runs from the checkout with the machine's python3
#    (numpy) and the pinned tree's gguf-py;
# 2. generates a synthetic MoE of the study's layout and expert shape: qwen3next (Qwen3-Next: linear-attention and
#    gated full-attention layers alternating, a gated shared expert of 512), 512 experts per layer of 2048x512
#    (n_embd 2048, expert FFN 512), top-10, --layers N layers (default 2: one of each attention kind; the study's
#    model has 48), --dtype q4_k_m (default: written in f16 and quantized by the build's llama-quantize on every
#    core, harness synth --quantize Q4_K_M: gate/up experts Q4_K, the down experts of the layers llama-quantize
#    gives more bits in Q6_K, as in the Q4_K_M GGUFs people run). The default model (2 layers): 6.3 GiB of f16
#    written, 1.9 GiB at Q4_K_M; 424 CPU-seconds in all, about 125 writing (6 large tensors encoded at once) and
#    300 quantizing (every core); measured 2026-12-01 on the shared 2-core machine (load 10-13): 18 minutes
#    wall; on the 16-core machine about a minute;
# 3. a VRAM budget that holds the non-expert weights plus about --budget-pct (default 25) percent of the experts
#    (plus a reserve for the KV cache and compute buffers);
# 4. llama-bench, decode (tg64) and prompt (pp512), under that budget:
#    - stock with the best --n-cpu-moe that fits the budget (computed from the tensor sizes),
#    - patched: fetch-all, quality, speed (mode=engine, vram=budget, bypass=32, every expert tensor in RAM),
#    each run sampled by nvidia-smi every 100 ms: the peak VRAM it used (over the idle baseline);
# 5. prints a table: tokens/s (mean and 95% CI over --reps repetitions) and peak VRAM per run, and writes
#    DIR/results.jsonl (llama-bench JSON lines with samples_ns) and DIR/summary.txt.
#
# --dry-run prints what it would run (no GPU, no build, no model needed). Sized to finish in under 10 minutes on
# a 16-core H200 machine including the build (ccache helps on reruns). Exit status 0 when every run succeeded.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dry=0
offline=0
layers=2
dtype=q4_k_m
budget_pct=25
reps=3
cuda_arch=90
out="$root/build/gpu-check"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --offline) offline=1 ;;
        --layers) layers=${2:?}; shift ;;
        --dtype) dtype=${2:?}; shift ;;
        --budget-pct) budget_pct=${2:?}; shift ;;
        --reps) reps=${2:?}; shift ;;
        --cuda-arch) cuda_arch=${2:?}; shift ;;
        --out) out=${2:?}; shift ;;
        -h|--help) sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$dtype" in q4_k_m|q4_0|q8_0|f16) ;; *) echo "gpu_check.sh: error: --dtype takes q4_k_m, q4_0, q8_0 or f16" >&2; exit 2 ;; esac

n_expert=512
top_k=10
n_embd=2048
n_ff=512
MiB=$((1024 * 1024))

# bytes per weight of the expert tensors: q4_0 = 18 bytes per 32, q8_0 = 34 per 32, f16 = 2; q4_k_m: Q4_K (144 bytes
# per 256) for gate and up, and for down Q6_K (210 per 256) in the layers llama-quantize's use_more_bits picks
# (the first and last eighth, every third between), Q4_K elsewhere
more_bits() {  # layer -> 0/1, llama-quant.cpp's use_more_bits(i_layer, n_layer)
    local i=$1 n=$layers
    [ "$i" -lt $((n / 8)) ] || [ "$i" -ge $((7 * n / 8)) ] || [ $(( (i - n / 8) % 3 )) -eq 2 ] && echo 1 || echo 0
}
layer_bytes() {  # layer -> bytes of its experts
    local gu_num gu_den d_num d_den
    case "$dtype" in
        q4_0) gu_num=18; gu_den=32; d_num=18; d_den=32 ;;
        q8_0) gu_num=34; gu_den=32; d_num=34; d_den=32 ;;
        f16)  gu_num=2;  gu_den=1;  d_num=2;  d_den=1 ;;
        q4_k_m) gu_num=144; gu_den=256; d_num=144; d_den=256
                [ "$(more_bits "$1")" = 1 ] && d_num=210 ;;
    esac
    echo $(( n_expert * n_embd * n_ff * (2 * gu_num * d_den + d_num * gu_den) / (gu_den * d_den) ))
}
total_expert_bytes=0
layer_expert_bytes=0  # the largest layer
for ((il = 0; il < layers; il++)); do
    b=$(layer_bytes "$il")
    total_expert_bytes=$((total_expert_bytes + b))
    [ "$b" -gt "$layer_expert_bytes" ] && layer_expert_bytes=$b
done
# non-expert weights: embeddings/output (vocab 32k) and attention, generously
other_bytes=$((2 * 32000 * n_embd * 2 + layers * 4 * n_embd * n_embd * 2 + 256 * MiB))
reserve=$((1024 * MiB))                                             # KV cache + compute buffers
resident_bytes=$((total_expert_bytes * budget_pct / 100))
budget=$((other_bytes + reserve + resident_bytes))
budget_mib=$((budget / MiB))
# stock: layers whose experts stay on the GPU must fit whole; the rest go to the CPU (--n-cpu-moe)
# (--n-cpu-moe N keeps the experts of the first N layers on the CPU: the GPU holds the last layers that fit)
ncmoe=$layers
fit_bytes=$((budget - other_bytes - reserve))
while [ "$ncmoe" -gt 0 ]; do
    b=$(layer_bytes $((ncmoe - 1)))
    [ "$b" -le "$fit_bytes" ] || break
    fit_bytes=$((fit_bytes - b))
    ncmoe=$((ncmoe - 1))
done

model="$out/synth-qwen3next-e${n_expert}k${top_k}-L${layers}-${dtype}.gguf"
if [ "$offline" = 0 ] && [ -f "$root/.gpu/trees.tar.xz" ] && [ ! -x "$root/.venv/bin/python" ]; then
    offline=1
fi
if [ "$offline" = 1 ]; then
    py=python3
    harness=(env "PYTHONPATH=$root:$root/vendor/llama.cpp/gguf-py" python3 -m harness)
    build_offline=(--offline)
else
    py="$root/.venv/bin/python"
    harness=("$root/.venv/bin/harness")
    build_offline=()
fi

run() {  # print, and run unless --dry-run
    echo "+ $*"
    [ "$dry" = 1 ] || "$@"
}

echo "gpu_check: model $layers layers x $n_expert experts (${n_embd}x${n_ff}, top-$top_k, $dtype):" \
     "$((total_expert_bytes / MiB)) MiB of experts, at most $((layer_expert_bytes / MiB)) MiB per layer"
echo "gpu_check: VRAM budget $budget_mib MiB (non-expert ~$((other_bytes / MiB)) MiB + reserve $((reserve / MiB)) MiB" \
     "+ $budget_pct% of the experts); stock: --n-cpu-moe $ncmoe"

t0=$(date +%s)
# ---- 1. builds
if [ "$dry" = 0 ]; then
    command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
        || { echo "gpu_check.sh: error: no NVIDIA GPU (nvidia-smi -L failed); use --dry-run to see the plan" >&2; exit 1; }
fi
if [ ! -d "$root/vendor/llama.cpp" ] && [ -f "$root/.gpu/trees.tar.xz" ]; then
    run tar -C "$root" -xJf "$root/.gpu/trees.tar.xz"
fi
# --share-ggml: ggml (nearly all of a CUDA build: ~67 CPU-minutes for one architecture) is compiled once, in
# the patched tree, and the stock tree links to it; the patches do not touch ggml/ (build.sh checks)
run "$root/build.sh" "${build_offline[@]}" --cuda --cuda-arch "$cuda_arch" --targets "llama-bench llama-quantize" --share-ggml \
    --jobs "$(nproc 2>/dev/null || echo 4)"
stock_bin="$root/vendor/llama.cpp/build-cuda/bin"
patched_bin="${MOE_SUBST_PATCHED_BIN:-$root/vendor/llama.cpp-patched/build-cuda/bin}"
echo "gpu_check: build done after $(( $(date +%s) - t0 )) s (stock $stock_bin, patched $patched_bin)"

# ---- 2. model
mkdir -p "$out"
if [ ! -f "$model" ]; then
    if [ "$dtype" = q4_k_m ]; then
        synth_type=(--quantize Q4_K_M)  # f16, then the build's llama-quantize (found through build/builds.json)
    else
        synth_type=(--dtype "$dtype")
    fi
    run "${harness[@]}" synth -o "$model" --arch qwen3next --layers "$layers" --experts "$n_expert" --top-k "$top_k" \
        --embd "$n_embd" --ff "$n_ff" --ff-shexp "$n_ff" --heads 16 --kv-heads 4 --vocab 32000 "${synth_type[@]}" \
        --seed 1
fi
echo "gpu_check: model ready after $(( $(date +%s) - t0 )) s"

# ---- 3. runs
results="$out/results.jsonl"
summary="$out/summary.txt"
[ "$dry" = 1 ] || : >"$results"
baseline=0
if [ "$dry" = 0 ]; then
    baseline=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1)
fi

bench() {  # name, env spec (or -), llama-bench args...
    local name=$1 spec=$2 bin=$3
    shift 3
    local cmd=("$bin/llama-bench" -m "$model" -r "$reps" -o jsonl --repack 0 -v "$@")  # -v: errors reach the log
    if [ "$dry" = 1 ]; then
        if [ "$spec" = - ]; then
            echo "+ [$name] ${cmd[*]}"
        else
            echo "+ [$name] LLAMA_MOE_CACHE=$spec ${cmd[*]}"
        fi
        return 0
    fi
    local mon="$out/$name.vram"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$mon" 2>/dev/null &
    local mon_pid=$!
    local rc=0
    if [ "$spec" = - ]; then
        env -u LLAMA_MOE_CACHE "${cmd[@]}" >"$out/$name.jsonl" 2>"$out/$name.log" || rc=$?
    else
        LLAMA_MOE_CACHE="$spec,stats=$out/$name.stats.json" "${cmd[@]}" >"$out/$name.jsonl" 2>"$out/$name.log" || rc=$?
    fi
    kill "$mon_pid" 2>/dev/null || true
    wait "$mon_pid" 2>/dev/null || true
    local peak
    peak=$(sort -n "$mon" | tail -n 1)
    peak=$(( ${peak:-0} - baseline ))
    "$py" - "$name" "$peak" "$budget_mib" "$rc" "$out/$name.jsonl" "$results" <<'PY'
import json, math, statistics, sys
name, peak, budget, rc, path, results = sys.argv[1:]
rows = [json.loads(l) for l in open(path) if l.strip().startswith("{")]
with open(results, "a") as f:
    for r in rows:
        r["gpu_check"] = {"run": name, "peak_vram_mib": int(peak), "budget_mib": int(budget), "rc": int(rc)}
        f.write(json.dumps(r) + "\n")
for r in rows:
    ts = r.get("samples_ts") or [r.get("avg_ts", 0.0)]
    m = statistics.mean(ts)
    ci = 1.96 * statistics.stdev(ts) / math.sqrt(len(ts)) if len(ts) > 1 else float("nan")
    test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
    flag = "" if int(peak) <= int(budget) else "  OVER BUDGET"
    print(f"{name:<16} {test:<6} {m:9.2f} t/s +/- {ci:7.2f} (95% CI, n={len(ts)})   peak VRAM {int(peak):7d} MiB{flag}")
if int(rc) != 0 or not rows:
    log = path[:-6] + ".log"
    try:
        why = [l.strip() for l in open(log, errors="replace") if "error" in l.lower() or "too small" in l][-2:]
    except OSError:
        why = []
    print(f"{name:<16} FAILED (exit {rc}); see {log}" + "".join(f"\n    {w[:400]}" for w in why))
PY
    return "$rc"
}

status=0
common=(-ngl 99 -p 512 -n 64 -fa on -lm none)  # -lm none: expert tensors in pinned host memory (no mmap)
if [ "$dry" = 0 ]; then
    exec > >(tee "$summary") 2>&1
fi
{
    echo "gpu_check: $(date -u +%FT%TZ) budget $budget_mib MiB, model $(basename "$model")"
    bench stock - "$stock_bin" "${common[@]}" -ncmoe "$ncmoe" || status=1
    for preset in fetch-all quality speed; do
        bench "engine-$preset" "mode=engine,policy=$preset,vram=${budget_mib}M,vram_reserve=$((reserve / MiB))M,bypass=32" "$patched_bin" \
            "${common[@]}" -ncmoe "$layers" || status=1
    done
    echo "gpu_check: total $(( $(date +%s) - t0 )) s"
}
[ "$dry" = 1 ] && exit 0
# per-layer host round trip: the route step's time per token-layer, from the engine's statistics
for f in "$out"/engine-*.stats.json; do
    [ -f "$f" ] && "$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); e=d.get("engine",{}); print(sys.argv[1].split("/")[-1], "route step %.1f us/token-layer," % (d["route_ns_per_token_layer"]/1e3), "copied %d experts, %.1f ms copying" % (e.get("copied_experts",0), e.get("copy_ns",0)/1e6), "hit rate %.3f" % d["total"]["hit_rate"])' "$f"
done
exit "$status"
