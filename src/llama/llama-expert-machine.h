#pragma once

// The machine's memory facts (moe-subst): what this process may really hold, from the memory cgroup it runs in (v2
// memory.max, v1 memory.limit_in_bytes, the tightest of its own cgroup and its parents, less what is charged there
// already) and from MemAvailable. The parsers are pure functions of the files' contents, and the reading goes through
// one function that reads a file, so that tests feed fake /proc and /sys text (tests/cpp/test_expert_policy.cpp,
// test_machine). No model, no ggml. Read by the ram=/vram= budget check (llama-expert-engine.cpp) and by
// `--moe-cache auto` (llama-expert-auto.h).

#include <cstdint>
#include <functional>
#include <string>

// Environment variable: a folder that stands in for "/" when the facts are read (LLAMA_MOE_CACHE_MACHINE_ROOT=/tmp/x
// reads /tmp/x/proc/meminfo, /tmp/x/proc/self/cgroup, /tmp/x/sys/fs/cgroup/...). For tests; unset on a real run.
#define LLAMA_EXPERT_MACHINE_ROOT_ENV "LLAMA_MOE_CACHE_MACHINE_ROOT"

// The runtime's baseline: what a llama.cpp process holds besides its weights, context, compute buffers and the cache
// (libraries' data, the vocabulary, thread stacks touched, the allocator's slack). Measured on the pinned CPU build
// (docs/expert-cache-engine.md, "What the process may use"); counted in every ram= plan.
#define LLAMA_EXPERT_RUNTIME_BASELINE (48ull << 20)

// With what the process holds known (RssAnon at context creation, which the KV cache is in), auto's file tier counts
// that, less the context (its own term), and this growth after creation in place of the fixed baseline: the threads'
// stacks, the samplers, the engine's own tables (measured: docs/expert-cache-engine.md, "What the process may use")
#define LLAMA_EXPERT_RUNTIME_GROWTH (8ull << 20)

// The runtime's term of a ram= plan: held (RssAnon at context creation) less the context, plus
// LLAMA_EXPERT_RUNTIME_GROWTH; LLAMA_EXPERT_RUNTIME_BASELINE when held is 0 (unknown)
uint64_t llama_expert_runtime_baseline(uint64_t held, uint64_t context);

struct llama_expert_machine {
    uint64_t    mem_total     = 0; // MemTotal (0: unknown)
    uint64_t    mem_available = 0; // MemAvailable (0: unknown)
    uint64_t    self_anon     = 0; // this process's anonymous resident memory (RssAnon): already in use, by us

    int         cgroup_version = 0; // 1 or 2; 0: no memory cgroup found
    std::string cgroup;             // the cgroup whose limit binds (a path under the hierarchy), "" when none does
    uint64_t    cgroup_limit   = 0; // its limit (0: no limit anywhere up the tree)
    uint64_t    cgroup_charged = 0; // what is charged there, page cache excepted (reclaimable), this process included

    // the bytes this process may hold in all, its own included: the cgroup's limit less what others hold there, and
    // MemAvailable plus what we hold already; UINT64_MAX when neither is known
    uint64_t usable() const;
    // one phrase for messages: "the memory cgroup /a/b (limit 150.0 MiB, 3.2 MiB used by others) and MemAvailable
    // 18.9 GiB"
    std::string describe() const;
};

// /proc/meminfo: MemTotal and MemAvailable in bytes; false when MemAvailable is missing
bool llama_expert_machine_parse_meminfo(const std::string & text, uint64_t & total, uint64_t & available);

// /proc/self/status: RssAnon in bytes (0 when missing)
uint64_t llama_expert_machine_parse_rss_anon(const std::string & text);

// /proc/self/cgroup: the memory controller's hierarchy version and this process's path in it. A v1 line that names
// the memory controller ("4:memory:/a" or "3:cpu,memory:/a") wins over the v2 line ("0::/a"), as the kernel charges
// memory to the v1 hierarchy when it is mounted. False when there is neither, or the path is outside our namespace.
bool llama_expert_machine_parse_cgroup(const std::string & text, int & version, std::string & path);

// memory.max (v2) or memory.limit_in_bytes (v1): the limit in bytes; 0 for none ("max", or v1's "unlimited", a
// page-rounded 2^63-1). False for text that is not a limit.
bool llama_expert_machine_parse_limit(const std::string & text, uint64_t & limit);

// memory.stat: the value of one key ("file" for v2, "total_cache" or "cache" for v1); 0 when missing
uint64_t llama_expert_machine_parse_stat(const std::string & text, const std::string & key);

// Reads one file into contents; false when it cannot (missing, unreadable).
typedef std::function<bool(const std::string & path, std::string & contents)> llama_expert_machine_reader;

// The facts, through `read` (paths from "/": "/proc/meminfo", "/sys/fs/cgroup/..."); the cgroup's limit is the
// tightest headroom of its own cgroup and every parent up to the hierarchy's root. Missing files leave facts unknown.
llama_expert_machine llama_expert_machine_read(const llama_expert_machine_reader & read);

// The facts of this process, from the real files (or under LLAMA_MOE_CACHE_MACHINE_ROOT).
llama_expert_machine llama_expert_machine_current();
