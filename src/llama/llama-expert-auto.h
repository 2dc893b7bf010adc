#pragma once

// `--moe-cache auto` (LLAMA_MOE_CACHE=auto): the cache's plan chosen from the model and the machine (moe-subst, issue
// 24). The decision is a pure function of two sets of facts, the model's (sizes, where its experts are, mmap, repack)
// and the machine's (what the process may use: llama-expert-machine.h; a GPU's free memory), so that
// tests/cpp/test_expert_auto.cpp feeds fake facts and checks the plans. The engine gathers the facts
// (llama_expert_engine_auto_facts) and the cache logs the plan in one line with why (llama-expert-cache.cpp).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

// the margin auto leaves of what the process may use (RAM) and of a device's room (VRAM), in percent: for the page
// cache the file tier reads through, other processes, and the estimate's own error
#define LLAMA_EXPERT_AUTO_MARGIN_PCT 10

// The model's facts at context creation (bytes).
struct llama_expert_auto_model {
    int32_t  n_expert = 0;   // routed experts per layer (0: not a MoE model)
    int32_t  k        = 0;   // experts used per token
    uint64_t weights  = 0;   // every weight but the routed experts, wherever it is
    uint64_t experts  = 0;   // the routed experts, all layers
    uint64_t context  = 0;   // the context's memory (KV cache), wherever it is
    uint64_t per_slot = 0;   // one expert in every bank of every MoE layer
    uint64_t n_banks  = 0;   // routed-expert tensors over all MoE layers
    uint64_t max_slice = 0;  // the largest expert slice of any tensor (a reader's buffer)
    bool     experts_host = true;  // the routed experts are in host memory (false: on a device, with the rest)
    bool     mapped       = true;  // the routed experts are mapped from the model file (host=file can read them)
    bool     repacked     = false; // an expert tensor is in a repacked CPU layout (the engine copies plain rows)
    std::string remote;            // a MoE layer is on a device reached over the network (ggml-rpc): its name
    // a GPU holds the MoE layers: its free memory now, and what of ours it holds already (the vram= budget counts them)
    bool     gpu         = false;
    uint64_t dev_free    = 0;
    uint64_t dev_weights = 0;
    uint64_t dev_context = 0;
    // the context's sizes that llama.cpp's compute buffers and logits follow (0: unknown, e.g. a unit test's facts:
    // the compute estimate is then the fixed LLAMA_EXPERT_AUTO_RESERVE_UNKNOWN)
    uint32_t n_ctx    = 0;
    uint32_t n_batch  = 0;   // the most outputs one batch may ask for (the logits buffer)
    uint32_t n_ubatch = 0;
    uint64_t n_vocab  = 0;
    uint64_t n_embd   = 0;
    uint64_t n_ff_exp = 0;   // one routed expert's hidden size (the largest of any layer)
    // what the process holds already at context creation (RssAnon: the runtime, the vocabulary, the KV cache, which
    // llama.cpp clears when it allocates it, and with --no-mmap or a repack the weights read in): counted in place of
    // the context and LLAMA_EXPERT_AUTO_STOCK_BASELINE when stock's fit is asked; 0: unknown (a unit test's facts)
    uint64_t held     = 0;
    uint32_t n_seq    = 1;   // the context's sequences: the logits' rows reserved at creation (a decode's outputs)
    // near the fit (stock's weights fit beside what the process holds, its estimate with the compute buffers and
    // logits does not): whether stock's weights stayed resident when touched, measured by the caller
    // (llama_expert_touch_resident, llama-expert-resident.h) when a plan says `unsure`: -1 not measured, 0 no, 1 yes
    int8_t   stock_fits     = -1;
    uint64_t stock_touched  = 0;   // the measurement's bytes of mapped weights touched
    uint64_t stock_resident = 0;   // of those, resident afterwards
};

// what auto counts for the runtime when it asks whether stock fits and the process's own memory is unknown (held = 0;
// with it known, the estimate is the held memory, the mapped weights and the compute buffers and logits in bytes: over
// stock's measured peaks in a memory cgroup by 0.3-2 MiB, eval/auto-vs-stock-3): the measured peak RSS of the pinned
// CPU build's tools beside a 1 MiB model (21 MiB llama-perplexity, 24 MiB an idle llama-server; docs/expert-cache-engine.md, "What
// the process may use"), without the budget's doubling (LLAMA_EXPERT_RUNTIME_BASELINE, which stands in for the margin
// that a ram= budget by hand does not leave): stock's weights are page cache, so a squeeze slows it gradually
#define LLAMA_EXPERT_AUTO_STOCK_BASELINE (24ull << 20)

// what a stock decode adds to what the process holds at context creation, beside the compute buffers of a one-token
// ubatch and its logits: studymoe's llama-bench -n 64 (--repack 0, 2 threads) peaked at 8.2 MiB of RssAnon where it
// held 6.5 MiB at creation. The ballast of the measurement near the fit (llama-expert-resident.h)
#define LLAMA_EXPERT_STOCK_DECODE_GROWTH (2ull << 20)

// the compute reserve auto counts when it knows none of the context's sizes (the spec's default vram_reserve)
#define LLAMA_EXPERT_AUTO_RESERVE_UNKNOWN (256ull << 20)

// What llama.cpp will allocate for the compute buffers of one ubatch: n_ubatch x max(4 x (n_vocab + 2 n_embd),
// 16 x k x n_ff_exp + 2 x n_ctx) bytes, the fit measured on the pin (docs/expert-cache-engine.md, "`--moe-cache auto`":
// 3 models x 2 ubatches x 2 contexts within 1 MiB), times 1.25 for what the fit did not see, rounded up to a MiB.
uint64_t llama_expert_auto_compute_bytes(const llama_expert_auto_model & m);

// The logits' output buffer, in host memory: 4 x n_vocab x n_batch bytes (a batch may ask for every token's logits,
// as llama-perplexity does), rounded up to a MiB.
uint64_t llama_expert_auto_output_bytes(const llama_expert_auto_model & m);

// The plan: the cache off (stock), a spec (its keys in order), or a one-line error; `why` is the one-line reason.
struct llama_expert_auto_plan {
    bool        off = true;
    std::vector<std::pair<std::string, std::string>> keys;
    std::string why;
    std::string err;   // non-empty: refuse the context with this line
    int32_t     slots = 0;     // the planned slots per layer (0 when off)
    std::string policy_why;    // the end of `why` that names the policy and why it is that one
    // the runtime's term the file tier's ram= was planned with (llama_expert_runtime_baseline of the held memory), which
    // the engine counts in place of LLAMA_EXPERT_RUNTIME_BASELINE; 0: the constant (held unknown, or no file tier)
    uint64_t    runtime = 0;
    // near the fit and not measured (stock_fits -1): the file tier's plan, and the caller may measure whether stock's
    // weights stay resident (touching them beside `ballast` bytes, a decode's growth) and decide again with the answer
    bool        unsure  = false;
    uint64_t    ballast = 0;

    // "mode=engine,policy=quality,host=file,ram=1843M" ("mode=off" when off)
    std::string spec() const;
};

// The decision. usable and facts: llama_expert_machine::usable() and describe(); reserve: the user's vram_reserve (the
// compute buffers and, on a CPU machine, the logits), 0 when not given: auto counts llama_expert_auto_compute_bytes and
// llama_expert_auto_output_bytes then, and writes the sum as the plan's vram_reserve=; readers: the file tier's reader
// threads; policy: the preset to run ("" = quality, or the user's: policy_given; a tuned profile's choice replaces it
// afterwards: llama_expert_auto_set_policy).
llama_expert_auto_plan llama_expert_auto_decide(const llama_expert_auto_model & m, uint64_t usable,
        const std::string & facts, uint64_t reserve, int32_t readers, const std::string & policy,
        bool policy_given = false);

// Whether a spec asks for auto: "auto", or "auto,key=value,..." (rest: the keys after it, which the user gives to
// override or add to the plan's: "auto,stats=s.json", "auto,policy=speed").
bool llama_expert_auto_requested(const std::string & spec, std::string & rest);

// Whether the user's keys after `auto` give `key`.
bool llama_expert_auto_user_gives(const std::string & rest, const std::string & key);

// The user's items after `auto` whose key is one of `keys`, in their order ("vram_reserve=16M,policy=speed"): the keys
// the decision reads, parsed without the others (a key valid only beside the plan's, such as tau=, must not make the
// decision lose them).
std::string llama_expert_auto_user_items(const std::string & rest, const std::vector<std::string> & keys);

// The spec to run: the plan's keys, those the user gave in `rest` replaced by the user's values, then the user's
// other keys; the user's slots= replaces the plan's ram=/vram= too (a budget computes the slots). An off plan with
// user keys stays off ("mode=off," + rest: the parser warns that they have no effect), unless they give mode=: then
// the user's keys run as given.
std::string llama_expert_auto_spec(const llama_expert_auto_plan & plan, const std::string & rest);

// The plan's items that the user's keys in `rest` replaced ("tau=0.08,ram=114M"), for the plan line; "" when none.
std::string llama_expert_auto_overridden(const llama_expert_auto_plan & plan, const std::string & rest);

// The plan with another policy (a tuned profile's: llama-expert-tuned.h): `policy`'s spec keys in place of the plan's
// policy=... item and `policy_why` in place of the end of `why` that named it; policy "" keeps the plan's keys (only the
// reason changes). Nothing for a plan that is off or an error.
void llama_expert_auto_set_policy(llama_expert_auto_plan & plan, const std::string & policy,
        const std::string & policy_why);
