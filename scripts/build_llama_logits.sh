#!/usr/bin/env bash
# Compile scripts/llama_logits.cpp against the stock llama.cpp build made by ./build.sh.
# Usage: scripts/build_llama_logits.sh [OUT]   (default build/llama_logits)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build/llama_logits}"
tree="$root/vendor/llama.cpp"
bin="$tree/build-cpu/bin"
[ -f "$bin/libllama.so" ] || { echo "no stock build at $bin (run ./build.sh)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
g++ -O2 -std=c++17 -I "$tree/include" -I "$tree/ggml/include" "$root/scripts/llama_logits.cpp" \
    -L "$bin" -lllama -lggml -lggml-base -Wl,-rpath,"$bin" -o "$out"
echo "$out"
