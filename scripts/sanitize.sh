#!/usr/bin/env bash
# The full sanitizer run (issue 15): the patched tree built with AddressSanitizer + UndefinedBehaviorSanitizer
# (./build.sh --sanitize: libllama with our C++, common and the tools), then the engine's tests and the input fuzzer
# against that build. Every sanitizer report fails the run (halt_on_error). The reports go to files (ASan's and
# UBSan's log_path, build/sanitize/reports/), which are checked after all runs: a report on an error path (every
# refusal test expects a non-zero exit, so its test passes) is never lost in a passing test's output. The bounded
# version CI runs is tests/test_sanitize.py (our policy module alone).
#
#   scripts/sanitize.sh                 # build (a cold build takes over an hour on 2 cores), tests, fuzz
#   scripts/sanitize.sh --no-build      # the tests and the fuzzer against an existing build-cpu-asan
#   scripts/sanitize.sh -k engine_eq    # extra arguments go to pytest
#   SANITIZE_TESTS="tests/test_engine.py" scripts/sanitize.sh --no-build   # other test files
#
# Writes build/sanitize/{pytest.log,fuzz.log,fuzz.json,summary.txt} and reports/{asan,ubsan}.<pid> (one file per
# process that reported); exit status 0 only with no report and every test passed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

build=1
jobs=${JOBS:-2}
if [ "${1:-}" = "--no-build" ]; then build=0; shift; fi

bin=vendor/llama.cpp-patched/build-cpu-asan/bin
out=build/sanitize
mkdir -p "$out"
if [ "$build" = 1 ]; then
    ./build.sh --sanitize --jobs "$jobs" --targets "llama llama-perplexity llama-moe-sim llama-cli llama-server llama-bench"
fi
for t in llama-perplexity llama-moe-sim llama-cli llama-server llama-bench; do
    [ -x "$bin/$t" ] || { echo "sanitize.sh: error: $bin/$t is missing: run without --no-build" >&2; exit 1; }
done

# detect_leaks: a leak at exit is a report too; abort_on_error=0 so that the tools exit (non-zero) with the report
# verify_asan_link_order=0: the tests preload their log drain (scripts/log_drain_preload.c) ahead of the runtime
# log_path: every report into a file of its own (<path>.<pid>), whatever the test expected of the exit status
reports_dir="$root/$out/reports"
rm -rf "$reports_dir"
mkdir -p "$reports_dir"
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=0:verify_asan_link_order=0:log_path=$reports_dir/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$reports_dir/ubsan"
export MOE_SUBST_PATCHED_BIN="$root/$bin"

# The tests that run the patched tools with the cache on (the bindings load a stock-built Python package: skipped)
set +e
tests=${SANITIZE_TESTS:-tests/test_engine.py tests/test_prefetch.py tests/test_expert_cache.py tests/test_layouts.py \
tests/test_compare_ram.py}
# shellcheck disable=SC2086
.venv/bin/python -m pytest -q -ra -p no:cacheprovider $tests "$@" > "$out/pytest.log" 2>&1
rc_tests=$?
# the sanitized tools only (the harness targets are Python: nothing for the sanitizers to see)
.venv/bin/python scripts/fuzz_inputs.py --bin "$bin" --targets "llama-perplexity,llama-moe-sim" --case-timeout 120 \
    --time-limit "${SANITIZE_FUZZ_SECONDS:-600}" --json "$out/fuzz.json" \
    --keep "$out/fuzz-findings" > "$out/fuzz.log" 2>&1
rc_fuzz=$?
set -e

reports=$(cat "$out/pytest.log" "$out/fuzz.log" | grep -c -E "ERROR: (Address|Leak)Sanitizer|runtime error:" || true)
# every sanitized process that reported left a non-empty <log_path>.<pid>, wherever its output went
report_files=$(find "$reports_dir" -type f -size +0 | sort)
n_files=0
[ -z "$report_files" ] || n_files=$(printf '%s\n' "$report_files" | wc -l)
{
    echo "sanitize.sh: $(date -u +%FT%TZ), build $bin"
    echo "tests: $(tail -1 "$out/pytest.log") (exit $rc_tests)"
    echo "fuzz: $(tail -1 "$out/fuzz.log") (exit $rc_fuzz)"
    echo "sanitizer reports in the logs: $reports"
    echo "sanitizer report files (log_path) in $out/reports: $n_files"
    for f in $report_files; do
        echo "  $f: $(grep -m1 -E "ERROR: |runtime error:" "$f" || head -1 "$f")"
    done
} | tee "$out/summary.txt"
[ "$rc_tests" = 0 ] && [ "$rc_fuzz" = 0 ] && [ "$reports" = 0 ] && [ "$n_files" = 0 ]
