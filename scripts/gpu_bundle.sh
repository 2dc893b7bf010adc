#!/usr/bin/env bash
# Pack what scripts/gpu_check.sh needs on a machine without network (the lent GPU machine) into .gpu/:
#
#   scripts/gpu_bundle.sh [--out DIR]   after ./build.sh here; writes DIR/trees.tar.xz (default .gpu/, which
#                                       git ignores; carry it: `carry: [".gpu"]`)
#
# The GPU machine gets the working tree (tracked files) plus the folders named in `carry`, 64 MiB in all, and
# can fetch nothing: no pip, no sdist. The bundle holds the two source trees exactly as ./build.sh made them
# here (stock, and patched with the series applied), without their build folders, their git data and the parts
# a CUDA build of the tools does not read (vocabulary models, docs, other GPU backends). xz packs the two
# trees' identical files (all of ggml) almost for free. gpu_check.sh unpacks it when vendor/ is missing and
# builds with ./build.sh --offline (no harness install; the harness runs from the checkout with the machine's
# python3 and the gguf-py package of the pinned tree).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
die() { echo "gpu_bundle.sh: error: $*" >&2; exit 1; }
out="$root/.gpu"
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=${2:?--out needs a folder}; shift ;;
        -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (see --help)" ;;
    esac
    shift
done

# shellcheck source=UPSTREAM
. "$root/UPSTREAM"
pin="llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION $LLAMA_CPP_PYTHON_SHA256"
[ "$(cat vendor/llama.cpp/.moe-subst-pin 2>/dev/null)" = "$pin" ] || die "no vendor/llama.cpp of the pin: run ./build.sh first"
[ -d vendor/llama.cpp-patched/.git ] || die "no vendor/llama.cpp-patched: run ./build.sh first"
series=$("$root/scripts/patches.sh" patches-hash)
applied=$(sed -n 1p vendor/llama.cpp-patched/.git/moe-subst-applied 2>/dev/null || true)
[ "$applied" = "$pin $series" ] || die "vendor/llama.cpp-patched is not the current series ($series): run ./build.sh"
[ -z "$(git -C vendor/llama.cpp-patched status --porcelain --untracked-files=no)" ] \
    || die "vendor/llama.cpp-patched has uncommitted changes: commit and export them (scripts/patches.sh export)"

mkdir -p "$out"
printf '%s\n' "$pin $series" >vendor/llama.cpp-patched/.moe-subst-bundle
excludes=(--exclude='vendor/llama.cpp/build-*' --exclude='vendor/llama.cpp-patched/build-*' --exclude='.git' --exclude='*.gguf' --exclude='*.gguf.inp' --exclude='*.gguf.out'
          --exclude='docs' --exclude='.github' --exclude='media' --exclude='*.png' --exclude='*.jpg'
          --exclude='ggml-vulkan' --exclude='ggml-sycl' --exclude='ggml-metal' --exclude='ggml-opencl'
          --exclude='ggml-cann' --exclude='ggml-musa' --exclude='ggml-hip' --exclude='ggml-webgpu'
          --exclude='ggml-zdnn' --exclude='ggml-kompute' --exclude='ggml-hexagon' --exclude='ggml-zendnn'
          --exclude='ggml-virtgpu' --exclude='ggml-openvino')
tar -C "$root" "${excludes[@]}" -cf - vendor/llama.cpp vendor/llama.cpp-patched | xz -T0 -9 >"$out/trees.tar.xz.tmp"
mv "$out/trees.tar.xz.tmp" "$out/trees.tar.xz"
rm -f vendor/llama.cpp-patched/.moe-subst-bundle
size=$(stat -c %s "$out/trees.tar.xz")
# the trained models' GGUFs (models/*.gguf: tinymoe 44 MB, studymoe 87 MB) do not fit beside the rest: gpu_check.sh
# reads none of them, so a device run moves them out of the checkout first (and back after); all else travels
tracked=$(git ls-files -z -- . ':(exclude)models/*.gguf' | xargs -0 du -cb | tail -n 1 | cut -f1)
echo "gpu_bundle.sh: $out/trees.tar.xz $((size / 1024)) KiB (series $series); with the tracked files but" \
     "models/*.gguf $(((size + tracked) / 1024 / 1024)) MiB of the 64 MiB that travel"
[ $((size + tracked)) -lt $((64 * 1024 * 1024)) ] || die "the bundle and the tracked files exceed 64 MiB"
echo "gpu_bundle.sh: before a device run, move models/*.gguf out of the checkout (they would not fit: 64 MiB)"
echo "gpu_bundle.sh: on the GPU machine: bash scripts/gpu_check.sh --out \$OUT/gpu-check   (carry: .gpu)"
