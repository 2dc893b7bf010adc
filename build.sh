#!/usr/bin/env bash
# Build everything: the Python harness (.venv), and stock + patched llama.cpp from the one pin in UPSTREAM.
#
#   ./build.sh                     CPU builds (CUDA automatically when nvcc and an NVIDIA GPU are present)
#   ./build.sh --cuda              CUDA builds (cuBLAS from the nvidia-cublas wheel when the system has none)
#   ./build.sh --cuda-arch 90      CUDA architectures (CMAKE_CUDA_ARCHITECTURES); implies --cuda
#   ./build.sh --cpu               force the CPU backend
#   ./build.sh --vulkan            Vulkan builds in build-vulkan of the tools the tests run (libllama, llama-cli,
#                                  -server, -perplexity, -bench); the CPU builds stay, build/builds.json lists these
#                                  as stock-vulkan and patched-vulkan. Debian/Ubuntu packages: glslc libvulkan-dev
#                                  spirv-headers, and mesa-vulkan-drivers (lavapipe) for a Vulkan device on the CPU,
#                                  which ggml-vulkan uses only with GGML_VK_VISIBLE_DEVICES=0
#   ./build.sh --only stock|patched|harness
#   ./build.sh --jobs N
#   ./build.sh --targets "llama-bench llama-cli"   build only these tools (default: all six and ggml-rpc-server, + llama-moe-sim;
#                                  llama-quantize makes the K-quant test models: harness synth --quantize)
#   ./build.sh --share-ggml        build ggml once (in the patched tree) and link the stock tree to it: the
#                                  patches do not touch ggml/ (checked), so this halves a CUDA build
#   ./build.sh --offline           no network: no harness install (python3 runs the helpers), no download; the
#                                  trees must exist (./build.sh, or scripts/gpu_bundle.sh's .gpu/ unpacked)
#   ./build.sh --bindings          also install llama-cpp-python into .venv: the pinned sdist's Python package,
#                                  without its C++ build; LLAMA_CPP_LIB_PATH=<patched bin> loads the patched libllama
#   ./build.sh --sanitize          the patched tree with AddressSanitizer + UndefinedBehaviorSanitizer, in its own
#                                  build-<backend>-asan (build/builds.json unchanged); run the tests against it with
#                                  MOE_SUBST_PATCHED_BIN=vendor/llama.cpp-patched/build-cpu-asan/bin
#
# Idempotent: a second run with nothing changed finishes in seconds.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$root"

backend=auto
cuda_arch=
only=
jobs=$(nproc 2>/dev/null || echo 2)
offline=0
share_ggml=0
bindings=0
want_targets=
sanitize=0
while [ $# -gt 0 ]; do
    case "$1" in
        --cuda) backend=cuda ;;
        --cpu) backend=cpu ;;
        --vulkan) backend=vulkan ;;
        --cuda-arch) backend=cuda; cuda_arch=${2:?--cuda-arch needs a value, e.g. 86 or 90}; shift ;;
        --cuda-arch=*) backend=cuda; cuda_arch=${1#*=} ;;
        --only) only=${2:?--only needs stock, patched or harness}; shift ;;
        --only=*) only=${1#*=} ;;
        --jobs|-j) jobs=${2:?--jobs needs a number}; shift ;;
        --offline) offline=1 ;;
        --share-ggml) share_ggml=1 ;;
        --bindings) bindings=1 ;;
        --targets) want_targets=${2:?--targets needs tool names}; shift ;;
        --sanitize) sanitize=1 ;;
        -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build.sh: error: unknown option $1 (see ./build.sh --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$only" in ""|stock|patched|harness) ;; *) echo "build.sh: error: --only takes stock, patched or harness" >&2; exit 2 ;; esac
if [ "$sanitize" = 1 ]; then
    case "$only" in ""|patched) only=patched ;; *) echo "build.sh: error: --sanitize builds the patched tree only" >&2; exit 2 ;; esac
    [ "$share_ggml" = 0 ] || { echo "build.sh: error: --sanitize does not go with --share-ggml" >&2; exit 2; }
fi

die() { echo "build.sh: error: $*" >&2; exit 1; }
t_all=$(date +%s)
t_phase=$t_all
phase() {
    local now
    now=$(date +%s)
    echo "build.sh: [$1] done in $((now - t_phase)) s"
    t_phase=$now
}

# ---- 0. tools, early -------------------------------------------------------------------------
command -v python3 >/dev/null || die "python3 not found (3.10 or newer is needed)"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "python3 is older than 3.10"
if [ "$only" != harness ]; then
    command -v cmake >/dev/null || die "cmake not found: install it (apt-get install cmake, or pip install cmake)"
    command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null \
        || die "no C++ compiler found: install one (apt-get install g++)"
    command -v git >/dev/null || die "git not found: the patch series is applied with git am"
fi

# shellcheck source=UPSTREAM
. "$root/UPSTREAM"
pin_version=$LLAMA_CPP_PYTHON_VERSION
pin_sha=$LLAMA_CPP_PYTHON_SHA256
pin_id="llama-cpp-python-$pin_version"

if [ "$backend" = auto ]; then
    backend=cpu
    if command -v nvcc >/dev/null && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        backend=cuda
    fi
fi

# ---- 1. the harness in .venv -----------------------------------------------------------------
venv="$root/.venv"
if [ "$offline" = 1 ]; then
    # no network: the helpers below run with the system's python3; the harness is not installed
    [ "$only" = harness ] && die "--offline cannot install the harness (pip needs the package index)"
    py=python3
    echo "build.sh: offline: the harness is not installed (run it from the checkout: PYTHONPATH=. python3 -m harness.cli)"
else
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "could not create .venv (on Debian: apt-get install python3-venv)"
    py="$venv/bin/python"
fi
harness_stamp="$venv/.moe-subst-harness"
harness_want="$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ "$offline" = 0 ] && [ "$(cat "$harness_stamp" 2>/dev/null)" != "$harness_want" ]; then
    echo "build.sh: installing the harness into .venv"
    "$py" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
    "$py" -m pip install -e "$root[dev]" >"$venv/pip-install.log" 2>&1 \
        || { tail -n 20 "$venv/pip-install.log" >&2; die "pip could not install the harness (log: .venv/pip-install.log)"; }
    echo "$harness_want" >"$harness_stamp"
fi
phase harness
[ "$only" = harness ] && { echo "build.sh: harness ready: .venv/bin/harness"; exit 0; }

if ! command -v ninja >/dev/null; then
    [ "$offline" = 1 ] && die "ninja not found (offline: install it, or pip install ninja where there is network)"
    [ -x "$venv/bin/ninja" ] || "$py" -m pip install --quiet ninja || die "ninja not found and pip could not install it"
    export PATH="$venv/bin:$PATH"
fi

# ---- 2. the pinned source, downloaded once, verified, cached ------------------------------------
cache=${MOE_SUBST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moe-subst}
sdist="$cache/llama_cpp_python-$pin_version.tar.gz"
mkdir -p "$cache"
sha_of() { sha256sum "$1" | cut -d' ' -f1; }
stock_tree="$root/vendor/llama.cpp"
patched_tree="$root/vendor/llama.cpp-patched"
need_sdist=0
[ "$(cat "$stock_tree/.moe-subst-pin" 2>/dev/null)" = "$pin_id $pin_sha" ] || need_sdist=1
[ "$bindings" = 1 ] && [ "$offline" = 1 ] && die "--bindings installs with pip (its build backend comes from the package index): not with --offline"
need_download=$need_sdist  # the bindings are installed from the sdist too
[ "$bindings" = 1 ] && need_download=1
if [ "$need_download" = 1 ] && [ -f "$sdist" ] && [ "$(sha_of "$sdist")" != "$pin_sha" ]; then
    die "the cached $sdist does not match the pinned sha256 ($pin_sha): delete it and run again"
fi
if [ "$need_download" = 1 ] && [ ! -f "$sdist" ] && [ "$offline" = 1 ]; then
    die "--offline: no vendor/llama.cpp of the pin and no cached $sdist (unpack scripts/gpu_bundle.sh's .gpu/trees.tar.xz, or copy the sdist there)"
fi
if [ "$need_download" = 1 ] && [ ! -f "$sdist" ]; then
    echo "build.sh: downloading llama-cpp-python==$pin_version (source distribution, ~77 MB) from the package index"
    tmp=$(mktemp -d)
    if ! "$py" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
            "llama-cpp-python==$pin_version" -d "$tmp" >"$tmp/log" 2>&1 \
        && ! "$py" -m pip download --quiet --no-deps --no-binary :all: \
            "llama-cpp-python==$pin_version" -d "$tmp" >>"$tmp/log" 2>&1; then
        tail -n 5 "$tmp/log" >&2
        rm -rf "$tmp"
        die "could not download llama-cpp-python==$pin_version and no cached copy exists at $sdist. Without network, copy the file llama_cpp_python-$pin_version.tar.gz (sha256 $pin_sha) there."
    fi
    got=$(find "$tmp" -name 'llama_cpp_python-*.tar.gz' | head -n 1)
    [ -n "$got" ] || { rm -rf "$tmp"; die "pip downloaded no source distribution"; }
    if [ "$(sha_of "$got")" != "$pin_sha" ]; then
        echo "build.sh: got sha256 $(sha_of "$got")" >&2
        rm -rf "$tmp"
        die "hash mismatch: the downloaded llama-cpp-python==$pin_version is not the pinned one ($pin_sha)"
    fi
    mv "$got" "$sdist"
    rm -rf "$tmp"
fi
phase fetch

# ---- 3. the two trees ---------------------------------------------------------------------------
if [ "$need_sdist" = 1 ]; then
    echo "build.sh: unpacking llama.cpp from $pin_id into vendor/llama.cpp"
    rm -rf "$stock_tree" "$stock_tree.tmp"
    mkdir -p "$stock_tree.tmp"
    tar -xzf "$sdist" -C "$stock_tree.tmp" --strip-components=3 \
        "llama_cpp_python-$pin_version/vendor/llama.cpp" || die "could not unpack $sdist"
    [ -f "$stock_tree.tmp/CMakeLists.txt" ] || die "$sdist has no vendor/llama.cpp/ tree"
    # The sdist keeps the submodule's .git pointer file; it points nowhere here.
    rm -rf "$stock_tree.tmp/.git"
    echo "$pin_id $pin_sha" >"$stock_tree.tmp/.moe-subst-pin"
    mv "$stock_tree.tmp" "$stock_tree"
fi
# build compatibility (patches/compat/, e.g. older Vulkan headers): applied to the stock tree in place, and so to the
# patched tree, whose base is the stock tree; a no-op when the stamp says it is there
"$root/scripts/patches.sh" compat "$sdist" || die "the compat series could not be applied (see above)"
if [ "$only" != stock ]; then
    if [ ! -d "$patched_tree/.git" ] && [ -f "$patched_tree/.moe-subst-bundle" ]; then
        # a tree unpacked from scripts/gpu_bundle.sh's bundle: the series was applied where it was made
        [ "$(cat "$patched_tree/.moe-subst-bundle")" = "$pin_id $pin_sha $("$root/scripts/patches.sh" patches-hash)" ] \
            || die "vendor/llama.cpp-patched comes from a bundle of another patch series: make the bundle again (scripts/gpu_bundle.sh)"
        echo "build.sh: vendor/llama.cpp-patched from a bundle of the current series"
    else
        "$root/scripts/patches.sh" apply || die "the patch series could not be applied (see above)"
    fi
fi
phase trees

# ---- 4. configure + build -----------------------------------------------------------------------
targets=(llama llama-cli llama-server llama-perplexity llama-bench llama-quantize ggml-rpc-server)
patched_targets=(llama-moe-sim)  # tools that only the patched tree has (patches/)
if [ "$backend" = vulkan ]; then
    # what the device tests and harness compare run (the CPU builds have llama-quantize and llama-moe-sim)
    targets=(llama llama-cli llama-server llama-perplexity llama-bench ggml-rpc-server)
    patched_targets=()
fi
if [ -n "$want_targets" ]; then
    read -r -a targets <<<"$want_targets"
    patched_targets=()
fi
cmake_common=(
    -G Ninja
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_NUMBER=0
    -DLLAMA_BUILD_COMMIT="$pin_id"
    # ggml's RPC backend (--rpc, ggml-rpc-server) in both trees: layers on another host (docs/expert-cache-engine.md,
    # "Beyond one machine"). Its cost with ccache warm: 4 compiles (ggml-rpc, its transport, the backend registry,
    # ggml-rpc-server); every other object is a ccache hit (the GGML_USE_RPC define changes no other preprocessed file)
    -DGGML_RPC=ON
)
if command -v ccache >/dev/null; then
    # Both trees build in <tree>/build-<backend>, so relative paths match and objects are shared.
    export CCACHE_BASEDIR="$root" CCACHE_NOHASHDIR=1 CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime
    cmake_common+=(-DGGML_CCACHE=ON)
else
    cmake_common+=(-DGGML_CCACHE=OFF)
    echo "build.sh: note: ccache not found; install it to make rebuilds fast (apt-get install ccache)"
fi
if [ "$backend" = vulkan ]; then
    # what ggml-vulkan's CMakeLists needs (find_package Vulkan with glslc, SPIRV-Headers), named by Debian package
    missing=()
    command -v glslc >/dev/null || missing+=(glslc)
    [ -f /usr/include/vulkan/vulkan.hpp ] || [ -n "${VULKAN_SDK:-}" ] || missing+=(libvulkan-dev)
    [ -d /usr/include/spirv ] || [ -n "${VULKAN_SDK:-}" ] || missing+=(spirv-headers)
    [ ${#missing[@]} = 0 ] || die "--vulkan: missing ${missing[*]} (apt-get install ${missing[*]}; mesa-vulkan-drivers for a device on the CPU)"
    cmake_common+=(-DGGML_VULKAN=ON)
    # glslc through a cache of its outputs (scripts/glslc_cache.cpp, compiled here): the two trees compile the same
    # shaders, and the second tree's are copies (ccache cannot cache glslc); MOE_SUBST_GLSLC_CACHE=off runs glslc as is
    export MOE_SUBST_GLSLC="${MOE_SUBST_GLSLC:-$(command -v glslc)}"
    mkdir -p "$root/vendor/build-tools"
    cxx=$(command -v c++ || command -v g++ || command -v clang++)
    if [ ! -x "$root/vendor/build-tools/glslc-cache" ] || [ "$root/scripts/glslc_cache.cpp" -nt "$root/vendor/build-tools/glslc-cache" ]; then
        "$cxx" -std=c++17 -O2 "$root/scripts/glslc_cache.cpp" -o "$root/vendor/build-tools/glslc-cache" \
            || die "--vulkan: cannot compile scripts/glslc_cache.cpp"
    fi
    cmake_common+=(-DVulkan_GLSLC_EXECUTABLE="$root/vendor/build-tools/glslc-cache")
fi
if [ "$backend" = cuda ]; then
    command -v nvcc >/dev/null || die "--cuda: nvcc not found (install the CUDA toolkit)"
    cmake_common+=(-DGGML_CUDA=ON)
    [ -n "$cuda_arch" ] && cmake_common+=(-DCMAKE_CUDA_ARCHITECTURES="$cuda_arch")
    if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so' && ! ls /usr/local/cuda/lib64/stubs/libcuda.so >/dev/null 2>&1; then
        # No driver library (a build-only machine): ggml's VMM memory pool links libcuda directly; build without it.
        echo "build.sh: note: no libcuda.so (NVIDIA driver) here; building with GGML_CUDA_NO_VMM=ON"
        cmake_common+=(-DGGML_CUDA_NO_VMM=ON)
    fi
    if ! ls /usr/local/cuda/lib64/libcublas.so* >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q libcublas.so; then
        cublas_root=$("$py" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("nvidia")
if spec and spec.submodule_search_locations:
    for base in spec.submodule_search_locations:
        for p in sorted(pathlib.Path(base).glob("cu*/lib/libcublas.so*")):
            print(p.parent.parent); raise SystemExit
PY
)
        if [ -z "$cublas_root" ]; then
            [ "$offline" = 1 ] && die "--offline: cuBLAS not found (no libcublas in the CUDA toolkit nor an nvidia-cublas package for $py)"
            echo "build.sh: cuBLAS not found on the system; installing the nvidia-cublas wheel into .venv"
            "$py" -m pip install --quiet nvidia-cublas || die "could not install nvidia-cublas (cuBLAS is needed for --cuda)"
            cublas_root=$("$py" -c 'import importlib.util,pathlib;b=importlib.util.find_spec("nvidia").submodule_search_locations[0];print(next(pathlib.Path(b).glob("cu*/lib/libcublas.so*")).parent.parent)') \
                || die "the nvidia-cublas wheel holds no libcublas"
        fi
        for l in "$cublas_root"/lib/libcublas.so.* "$cublas_root"/lib/libcublasLt.so.*; do
            [ -e "$l" ] && ln -sf "$(basename "$l")" "$(dirname "$l")/$(basename "$l" | sed 's/\.so\..*/.so/')"
        done
        cmake_common+=(-DCUDAToolkit_INCLUDE_DIRECTORIES="$cublas_root/include"
            -DCUDA_cublas_LIBRARY="$cublas_root/lib/libcublas.so"
            -DCUDA_cublasLt_LIBRARY="$cublas_root/lib/libcublasLt.so"
            -DCMAKE_CXX_FLAGS="-I$cublas_root/include" -DCMAKE_CUDA_FLAGS="-I$cublas_root/include"
            -DCMAKE_BUILD_RPATH="$cublas_root/lib")
    fi
fi

build_suffix=
if [ "$sanitize" = 1 ]; then
    # ASan + UBSan (llama.cpp's own options) on libllama (our src/ included), common and the tools; ggml keeps the
    # normal flags (its objects come from ccache; MOE_SUBST_SANITIZE_GGML=1 sanitizes it too, a much longer build)
    build_suffix=-asan
    cmake_common+=(-DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON)
    if [ "${MOE_SUBST_SANITIZE_GGML:-0}" = 1 ]; then
        cmake_common+=(-DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON)
    fi
fi

build_tree() {  # name tree [extra cmake args]
    local name=$1 tree=$2 dir="$2/build-$backend$build_suffix" args_stamp want
    shift 2
    local args=("${cmake_common[@]}" "$@")
    # the patched tree compiles moe-subst's own C++ (src/) into its targets (src/moe-subst.cmake)
    [ "$name" = patched ] && args+=(-DMOE_SUBST_SOURCE_DIR="$root/src")
    want=$(printf '%s\n' "${args[@]}" | sha256sum | cut -c1-16)
    args_stamp="$dir/.moe-subst-cmake-args"
    if [ ! -f "$dir/build.ninja" ] || [ "$(cat "$args_stamp" 2>/dev/null)" != "$want" ]; then
        echo "build.sh: configuring $name ($backend)"
        rm -f "$dir/CMakeCache.txt"
        cmake -S "$tree" -B "$dir" "${args[@]}" >"$dir.configure.log" 2>&1 \
            || { tail -n 30 "$dir.configure.log" >&2; die "cmake could not configure the $name tree (log: $dir.configure.log)"; }
        echo "$want" >"$args_stamp"
    fi
    local tgts=("${targets[@]}")
    [ "$name" = patched ] && tgts+=("${patched_targets[@]}")
    echo "build.sh: building $name ($backend): ${tgts[*]}"
    cmake --build "$dir" --parallel "$jobs" --target "${tgts[@]}" >"$dir.build.log" 2>&1 \
        || { grep -E 'error|Error' "$dir.build.log" | head -n 20 >&2; tail -n 20 "$dir.build.log" >&2; die "the $name build failed (log: $dir.build.log)"; }
    phase "build $name"
}
if [ "$share_ggml" = 1 ] && [ -z "$only" ]; then
    # one ggml for both trees: built in the patched tree, installed next to its build, found by the stock tree
    diff -rq "$stock_tree/ggml" "$patched_tree/ggml" >/dev/null \
        || die "--share-ggml: vendor/llama.cpp-patched/ggml differs from the stock tree's; build without --share-ggml"
    # the installed libggml finds its backends next to it, and cuBLAS where the build found it
    build_tree patched "$patched_tree" "-DCMAKE_INSTALL_RPATH=\$ORIGIN${cublas_root:+;$cublas_root/lib}"
    ggml_prefix="$patched_tree/build-$backend/ggml-install"
    cmake --install "$patched_tree/build-$backend/ggml" --prefix "$ggml_prefix" >"$patched_tree/build-$backend.ggml-install.log" 2>&1 \
        || die "--share-ggml: could not install ggml from the patched build (log: $patched_tree/build-$backend.ggml-install.log)"
    ggml_config=$(find "$ggml_prefix" -name ggml-config.cmake | head -n 1)
    ggml_lib=$(dirname "$(find "$ggml_prefix" -name 'libggml.so*' | head -n 1)")
    [ -n "$ggml_config" ] && [ -d "$ggml_lib" ] || die "--share-ggml: the ggml install in $ggml_prefix has no ggml-config.cmake or libggml.so"
    build_tree stock "$stock_tree" -DLLAMA_USE_SYSTEM_GGML=ON -Dggml_DIR="$(dirname "$ggml_config")" \
        -DCMAKE_BUILD_RPATH="$ggml_lib${cublas_root:+;$cublas_root/lib}"
else
    [ "$only" = patched ] || build_tree stock "$stock_tree"
    [ "$only" = stock ] || build_tree patched "$patched_tree"
fi

if [ "$sanitize" = 1 ]; then
    echo
    echo "build.sh: sanitized build in $(( $(date +%s) - t_all )) s: vendor/llama.cpp-patched/build-$backend-asan/bin"
    echo "  tests: MOE_SUBST_PATCHED_BIN=$patched_tree/build-$backend-asan/bin .venv/bin/python -m pytest tests/test_engine.py"
    exit 0
fi

# ---- 4b. the Python bindings (--bindings) ----------------------------------------------------------------
if [ "$bindings" = 1 ]; then
    # The pinned sdist's own llama_cpp package, so that its ctypes signatures are the pinned llama.h's; its C++
    # build is switched off (LLAMA_BUILD=OFF): the library is the patched build's, found through llama-cpp-python's
    # LLAMA_CPP_LIB_PATH. Seconds, not a third llama.cpp build.
    bindings_stamp="$venv/.moe-subst-bindings"
    if [ "$(cat "$bindings_stamp" 2>/dev/null)" != "$pin_id $pin_sha" ]; then
        echo "build.sh: installing llama-cpp-python==$pin_version into .venv (the pinned sdist's Python package, no C++ build)"
        "$py" -m pip uninstall --quiet -y llama_cpp_python >/dev/null 2>&1 || true
        CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$py" -m pip install "$sdist" >"$venv/pip-bindings.log" 2>&1 \
            || { tail -n 20 "$venv/pip-bindings.log" >&2; die "pip could not install the bindings (log: .venv/pip-bindings.log)"; }
        echo "$pin_id $pin_sha" >"$bindings_stamp"
    fi
    phase bindings
fi

# ---- 5. the manifest the harness reads --------------------------------------------------------------
mkdir -p "$root/build"
# A measurement aid preloaded into the tools by the harness and the tests: it drains llama.cpp's log at exit,
# which the stock build does not do (upstream issue 22142; see scripts/log_drain_preload.c).
cc_bin=$(command -v cc || command -v gcc || true)
if [ -n "$cc_bin" ]; then
    "$cc_bin" -shared -fPIC -O2 -o "$root/build/liblogdrain.so" "$root/scripts/log_drain_preload.c" \
        || echo "build.sh: note: could not build build/liblogdrain.so; stock runs may lose their last log lines"
fi
series_hash=$("$root/scripts/patches.sh" hash)
"$py" - "$root/build/builds.json" "$backend" "$pin_id" "$pin_sha" "$series_hash" "$stock_tree/build-$backend/bin" "$patched_tree/build-$backend/bin" "$only" <<'PY'
import json, sys, pathlib
out, backend, pin, sha, series, stock_bin, patched_bin, only = sys.argv[1:]
path = pathlib.Path(out)
data = json.loads(path.read_text()) if path.exists() else {}
data.update({"schema_version": 1, "pin": pin, "pin_sha256": sha, "patch_series": series})
builds = data.setdefault("builds", {})
# the Vulkan builds are listed next to the CPU (or CUDA) ones, as stock-vulkan and patched-vulkan
suffix = "-vulkan" if backend == "vulkan" else ""
for name, bindir in (("stock", stock_bin), ("patched", patched_bin)):
    if only in ("", name):
        builds[name + suffix] = {"backend": backend, "bin": bindir}
path.write_text(json.dumps(data, indent=2) + "\n")
PY
echo
echo "build.sh: built in $(( $(date +%s) - t_all )) s ($backend backend, pin $pin_id, patch series $series_hash):"
tools=$(printf '%s,' "${targets[@]}" | sed 's/^llama,//; s/,$//')
[ "$only" = patched ] || echo "  stock:   vendor/llama.cpp/build-$backend/bin/{$tools}"
[ "$only" = stock ] || echo "  patched: vendor/llama.cpp-patched/build-$backend/bin/{$tools}"
if [ "$offline" = 0 ]; then
    echo "  harness: .venv/bin/harness"
    [ "$bindings" = 1 ] && echo "  python:  LLAMA_CPP_LIB_PATH=$patched_tree/build-$backend/bin .venv/bin/python  (import llama_cpp: the patched libllama)"
    echo
    echo "next: .venv/bin/harness doctor     (what was built)"
    echo "      .venv/bin/harness compare    (stock vs the expert cache on the trained model)"
fi
