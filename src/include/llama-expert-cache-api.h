#pragma once

// The MoE expert cache (moe-subst): its counters for applications (llama-server's /metrics and /props,
// bindings). Staging C++ API, like llama-ext.h: not ABI-stable. Call from the thread that decodes.

#include "llama.h"

#include <cstddef>
#include <cstdint>
#include <string>

#include "llama-expert-counters.h"

struct llama_expert_cache_counters {
    int32_t mode;      // 1 emulate, 2 engine
    int32_t n_slots;   // resident experts per MoE layer
    int32_t n_expert;
    int32_t group_max; // largest ubatch decided (and, in engine mode, computed from the banks) as a group
    int32_t async;     // engine: 1 when background admissions are asynchronous copies

    uint64_t bank_bytes; // engine: bytes of the cache banks

    // since the last reset (llama_perf_context_reset); engine counters are 0 in emulate mode
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_FIELD)
    LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_FIELD)
    LLAMA_EXPERT_ROUTE_COUNTERS(LLAMA_EXPERT_COUNTER_FIELD)
};

// C linkage: bindings that load libllama by symbol name (llama-cpp-python's ctypes, harness.tools.bindings) call
// these as llama.h's functions
extern "C" {

// false when the context has no expert cache (LLAMA_MOE_CACHE unset or mode=off)
LLAMA_API bool llama_expert_cache_counters_get(const struct llama_context * ctx, struct llama_expert_cache_counters * out);

// The counters as Prometheus text rows (llamacpp:moe_cache_*, for llama-server's /metrics), and the cache's
// configuration as a JSON object (for /props). Like snprintf: writes at most size bytes (NUL included) and
// returns the length of the whole text; 0 when the context has no expert cache.
LLAMA_API int32_t llama_expert_cache_metrics(const struct llama_context * ctx, char * buf, size_t size);
LLAMA_API int32_t llama_expert_cache_props  (const struct llama_context * ctx, char * buf, size_t size);

// The one line in which `--moe-cache auto` said what it chose for the context's model and why ("<spec>: <why>", or
// "off: <why>"), as logged (a warning, which llama-cli's default verbosity does not show: llama-server's /props carries
// it as moe_cache_auto and llama-cli prints it in its banner). Like snprintf; 0 when the context was not made with auto.
LLAMA_API int32_t llama_expert_cache_auto_plan(const struct llama_context * ctx, char * buf, size_t size);

// Async-signal-safe, from any thread: a thread of the cache writes the stats= and profile_out= files of every live
// expert cache now (each through a temporary file renamed over it), so that a process that may never reach its end
// keeps them (llama-server on its first SIGTERM or SIGINT: under load it hangs there, upstream's behaviour). Returns
// at once; does nothing when no cache has such files (the cache off: no thread, no file).
LLAMA_API void llama_expert_cache_write_files(void);

// The process's expert-cache health, for a health check (llama-server's /health: 503 with this line): 0 while no expert
// cache of the process has failed, else the length of the first failure's line (a model file changed under
// host=file, a failed read or copy: every later decode of that cache fails). Like snprintf. Any thread.
LLAMA_API int32_t llama_expert_cache_health(char * buf, size_t size);

}

// either text as a std::string (empty when the context has no expert cache)
inline std::string llama_expert_cache_text(int32_t (*fn)(const llama_context *, char *, size_t), const llama_context * ctx) {
    const int32_t n = fn(ctx, nullptr, 0);
    if (n <= 0) {
        return std::string();
    }
    std::string s((size_t) n + 1, '\0');
    fn(ctx, &s[0], s.size());
    s.resize((size_t) n);
    return s;
}

// the health line as a std::string ("" while healthy)
inline std::string llama_expert_cache_health_text() {
    const int32_t n = llama_expert_cache_health(nullptr, 0);
    if (n <= 0) {
        return std::string();
    }
    std::string s((size_t) n + 1, '\0');
    llama_expert_cache_health(&s[0], s.size());
    s.resize((size_t) n);
    return s;
}
