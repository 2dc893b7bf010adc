#pragma once

// The expert cache's configuration (moe-subst): one spec string ("mode=emulate,policy=quality,slots=25%"), parsed in
// one place into llama_expert_cache_config, the checks that need the model (k, experts per layer), and the
// parameters a layer's policy decides with, resolved once (llama_expert_params).
//
// Two tables (tests/test_tables.py reads both; docs/extending.md says how to add a row):
//   - LLAMA_EXPERT_SPEC_KEYS: the spec keys, each with the values it accepts as an error names them; the parser
//     dispatches on it (a key's parser is spec_key_<key> in llama-expert-spec.cpp) and the "unknown key" error
//     lists it.
//   - LLAMA_EXPERT_CONFIG_FIELDS: the statistics' "config" block, in file order.

#include "llama-expert-params.h"
#include "llama-expert-rules.h"

#include <algorithm>
#include <cstdint>
#include <string>

// X(key, accepted): every key of the spec, in the order the "unknown key" error lists them. accepted: nullptr for
// rule (the rule table's names)
#define LLAMA_EXPERT_SPEC_KEYS(X) \
    X(mode,         "off, emulate, engine") \
    X(policy,       "quality, speed, fetch-all, drop-light") \
    X(rule,         nullptr) \
    X(tau,          "a number in [0, 1]") \
    X(tau_file,     "a number in [0, 1]") \
    X(j,            "a number of ranks in [0, k] always computed") \
    X(m,            "a window of router ranks in [k, n_expert], or auto (2k)") \
    X(alpha,        "a weight scale in [0, 1]") \
    X(kmin,         "a number of ranks in [1, k] always computed") \
    X(t,            "a ratio to the first choice's gate weight in [0, 1]") \
    X(lo,           "the band's lowest gate weight in [0, 1]") \
    X(hi,           "the band's upper gate weight bound in [0, 1] (1: none)") \
    X(min_rank,     "the first rank the band substitutes at, in [0, k] (0: any rank; 1: never the first choice)") \
    X(max_rank,     "the last rank the band substitutes at, in [0, k-1], not below min_rank (0: only the first choice)") \
    X(mass,         "the gate weight a token's substituted misses may sum to, in [0, 1]") \
    X(renorm,       "on (rescale the computed experts to the weight sum of all k) or off") \
    X(light,        "substitute (a resident expert computes instead) or host (the host computes the missed expert)") \
    X(evict,        "lfu, lru, classlru") \
    X(admit,        "off, on, or a threshold beta > 0") \
    X(halve,        "a number of tokens, 0 for never") \
    X(half_life,    "a number of tokens >= 1") \
    X(classes,      "a number of classes in [1, 32]") \
    X(slots,        "a count of experts per layer, or a percentage in (0, 100] such as 25%") \
    X(ram_slots,    "a count of experts per layer, or a percentage in (0, 100] such as 50%") \
    X(vram,         "a size such as 24G or 24GiB (binary), 24GB (decimal), 512M or a number of bytes") \
    X(vram_reserve, "a size such as 24G or 24GiB (binary), 24GB (decimal), 512M or a number of bytes") \
    X(ram,          "a size such as 8G or 8GiB (binary), 8GB (decimal), 512M or a number of bytes") \
    X(runtime,      "a size such as 16M (what the process holds besides the weights, context, compute reserve and banks)") \
    X(bypass,       "a ubatch size of at least 2 tokens, 0 for never") \
    X(group,        "a ubatch size in tokens (0 or 1: one-token ubatches only), or auto") \
    X(async,        "auto (a copy stream on GPUs), off (synchronous copies) or thread (a host copy thread, for RAM banks)") \
    X(host,         "ram (copy missed experts from the expert tensors in memory) or file (read them from the model file)") \
    X(readers,      "a number of reader threads, 1 to 64") \
    X(direct,       "auto (O_DIRECT reads where the file system allows them, else buffered), on (O_DIRECT or an error) or off (buffered reads)") \
    X(pack,         "auto (the expert pack MODEL.moe-pack next to the model file, when present), off, or an expert pack's path (harness pack)") \
    X(prefetch,     "on (admit the experts the next MoE layer's router predicts, in the background) or off") \
    X(prefetch_max, "a number of prefetched experts per layer and token, 1 to 65536 (the highest predicted first), or all") \
    X(profile,      "a file path") \
    X(profile_out,  "a file path") \
    X(profile_every, "a number of tokens, 0 for only at the end") \
    X(stats,        "a file path") \
    X(trace,        "a file path") \
    X(trace_top,    "a count of router probabilities per token and layer") \
    X(shadow,       "a number of ubatches (every that many, one is also computed exactly: the cache's measured cost), 0 for off")

enum llama_expert_cache_mode {
    LLAMA_EXPERT_CACHE_MODE_OFF     = 0,
    LLAMA_EXPERT_CACHE_MODE_EMULATE = 1,
    LLAMA_EXPERT_CACHE_MODE_ENGINE  = 2, // real cache banks and copies (llama-expert-engine.h)
};

// how engine mode copies background admissions
enum llama_expert_async {
    LLAMA_EXPERT_ASYNC_AUTO   = 0, // a copy stream where the device offers async copies and events, else off
    LLAMA_EXPERT_ASYNC_OFF    = 1, // synchronous copies
    LLAMA_EXPERT_ASYNC_THREAD = 2, // a host copy thread (banks in RAM)
};

// host=file: how the engine reads the model file
enum llama_expert_direct {
    LLAMA_EXPERT_DIRECT_AUTO = 0, // O_DIRECT where the file system and alignment allow it, else buffered reads
    LLAMA_EXPERT_DIRECT_ON   = 1, // O_DIRECT, or an error at start
    LLAMA_EXPERT_DIRECT_OFF  = 2, // buffered reads, the pages dropped from the page cache after each read
};

struct llama_expert_cache_config {
    std::string spec; // the spec string as given

    llama_expert_cache_mode mode = LLAMA_EXPERT_CACHE_MODE_OFF;
    std::string             preset = "fetch-all";

    llama_expert_miss_rule rule  = LLAMA_EXPERT_MISS_FETCH_ALL;
    float                  tau   = 0.15f; // rule=threshold; rule=zero: 0.03 unless given
    // rule=threshold with host=file: the threshold for misses read from the model file (a read costs ~10-20x a
    // copy from RAM); below 0: tau
    float                  tau_file = -1.0f;
    llama_expert_evict     evict = LLAMA_EXPERT_EVICT_LRU;
    bool                   admit = false;
    float                  beta  = 0.5f;

    // LFU: all use counts of a layer are halved every lfu_halve tokens of that layer (0: never)
    uint32_t lfu_halve = 1024;

    // ClassLRU (evict=classlru): half-life of the decayed use counts in tokens of the layer, number of classes
    uint32_t classlru_half_life = 128;
    uint32_t classlru_classes   = 8;

    // rule=cache-route: ranks < route_j always computed; substitutes from the router's top route_m (0: 2k);
    // a substitute's gate weight times route_alpha
    int32_t route_j     = 1;
    int32_t route_m     = 0;
    float   route_alpha = 1.0f;

    // rule=ser: the first ser_kmin ranks always run; a later rank runs if w > ser_t * w_0
    int32_t ser_kmin = 1;
    float   ser_t    = 0.1f;

    // rule=band: substitute a miss with gate weight in [band_lo, band_hi) (band_hi = 1: no upper bound)
    float   budget_mass   = 0.1f; // rule=budget: the summed gate weight a token's substituted misses stay within
    float   band_lo       = 0.0f;
    float   band_hi       = 1.0f;
    int32_t band_min_rank = 0; // ranks below it are fetched on a miss (1: the first choice is never substituted)
    int32_t band_max_rank = -1; // ranks above it are fetched on a miss (0: only a first choice is substituted); -1: none

    // rules that drop (drop, zero, ser): rescale the computed selections to the weight sum of all k (renorm=on)
    bool renorm = false;

    // rules that substitute: a light miss (not fetched by rank or weight) is computed on the host (light=host)
    bool light_host = false;

    // prefetch=on: the next MoE layer's router applied to this layer's input predicts that layer's k experts; the
    // predicted ones that are not resident are admitted in the background before that layer decides the token
    bool prefetch = false;
    // prefetch_max=N: at most N predicted experts admitted per layer and token (the first non-resident ones in the
    // prediction's rank order); 0 (all): every non-resident one of the k
    int32_t prefetch_max = 0;

    // residency: slots_count >= 0 wins, otherwise slots_pct percent of the layer's experts
    int32_t slots_count = -1;
    float   slots_pct   = 25.0f;

    // three tiers (host=file): a RAM tier of experts per layer between the slots and the model file
    // (ram_slots_count >= 0 wins, else ram_slots_pct > 0 percent; neither: two tiers). A miss the RAM tier holds
    // is copied from it (the threshold rule's tau), any other is read from the file into the RAM tier and the
    // slot (tau_file); the RAM tier evicts its least recently used expert
    int32_t ram_slots_count = -1;
    float   ram_slots_pct   = -1.0f;

    // residency by budget (mode engine or emulate): bytes of device memory for the non-expert weights, the
    // context and the cache banks there; the slots per layer are computed to fit (wins over slots)
    uint64_t vram         = 0;
    uint64_t vram_reserve = 256ull << 20; // left for the compute buffers, which are sized later (either budget)
    uint64_t ram = 0; // residency from a RAM budget (CPU builds, host=file): the experts stay in the file
    uint64_t runtime = 0; // with ram=: the runtime's term (what the process holds besides weights, context, reserve,
                          // banks and readers); 0: LLAMA_EXPERT_RUNTIME_BASELINE. auto writes what it measured

    // ubatches of at least this many tokens skip the policy: stock routing, then the residency is warmed
    // with the ubatch's most selected experts (prefill); 0: never
    uint32_t bypass = 0;

    // ubatches of at most this many tokens compute from the cache banks together, their experts held resident
    // for the whole ubatch (parallel sequences, speculative decoding), when group*k <= slots; -1: auto, the
    // most that fit (slots / k); 0 or 1: one-token ubatches only. Larger ubatches use the full expert tensors.
    int32_t group = -1;

    // how engine mode copies background admissions: auto (a second backend instance with its own stream and
    // an event per layer where the device offers them, else synchronous), off (synchronous), thread (a host
    // thread, for banks in RAM: CPU builds, tests)
    llama_expert_async async = LLAMA_EXPERT_ASYNC_AUTO;

    // where engine mode reads a missed expert's bytes: false (host=ram) from the expert tensors in memory,
    // true (host=file) straight from the model file, so that the mmap'd expert tensors cost no RAM
    bool host_file = false;
    // host=file: threads that read missed experts in parallel (the ubatch's fetches first, background admissions
    // after them), and whether reads bypass the page cache
    int32_t             readers = 4;
    llama_expert_direct direct  = LLAMA_EXPERT_DIRECT_AUTO;
    // host=file: the expert pack that serves each missed expert in one read: "" (auto: the model file's path +
    // ".moe-pack" when it exists; one that does not match the model is warned about and not used), "off", or a path
    // (one that does not match the model is an error)
    std::string         pack;

    std::string off_ignored; // mode=off: the other keys given, which have no effect (a warning names them)

    std::string profile;     // initial residency from a profile file (see profile_out)
    std::string profile_out; // write per-layer expert selection counts at the end
    uint32_t    profile_every = 0; // and every that many tokens during the run (0: only at the end)
    std::string stats;       // write statistics as JSON at the end
    std::string trace;       // write a binary router trace
    uint32_t    trace_top = 16; // router probabilities kept per token and layer in the trace
    uint32_t    shadow = 0; // the shadow estimate: every that many ubatches, one computed exactly too (0: off)
};

// The parameters a layer's policy decides with (llama-expert-params.h), resolved once from the configuration
llama_expert_params llama_expert_cache_config_params(const llama_expert_cache_config & cfg);

// X(field, type, value): the statistics' "config" block, in file order. type: STR (a JSON string), NAME (a C string
// without quotes to escape), FLOAT, INT, UINT, BOOL; value: an expression over cfg, par (the resolved parameters),
// n_expert, k (experts used per token) and n_slots
#define LLAMA_EXPERT_CONFIG_FIELDS(X) \
    X(spec,               STR,   cfg.spec) \
    X(mode,               NAME,  llama_expert_cache_mode_name(cfg.mode)) \
    X(policy,             NAME,  cfg.preset.c_str()) \
    X(rule,               NAME,  llama_expert_miss_rule_name(cfg.rule)) \
    X(tau,                FLOAT, cfg.tau) \
    X(host,               NAME,  cfg.host_file ? "file" : "ram") \
    X(tau_file,           FLOAT, par.tau_file) \
    X(ram_slots,          INT,   llama_expert_cache_config_n_ram_slots(cfg, n_expert)) \
    X(evict,              NAME,  llama_expert_evict_name(cfg.evict)) \
    X(admit,              BOOL,  cfg.admit) \
    X(beta,               FLOAT, cfg.beta) \
    X(lfu_halve,          UINT,  cfg.lfu_halve) \
    X(classlru_half_life, UINT,  cfg.classlru_half_life) \
    X(classlru_classes,   UINT,  cfg.classlru_classes) \
    X(route_j,            INT,   cfg.route_j) \
    X(route_m,            INT,   cfg.route_m > 0 ? cfg.route_m : std::min(n_expert, 2*k)) \
    X(route_alpha,        FLOAT, cfg.route_alpha) \
    X(ser_kmin,           INT,   cfg.ser_kmin) \
    X(ser_t,              FLOAT, cfg.ser_t) \
    X(band_lo,            FLOAT, cfg.band_lo) \
    X(band_hi,            FLOAT, cfg.band_hi) \
    X(band_min_rank,      INT,   cfg.band_min_rank) \
    X(band_max_rank,      INT,   cfg.band_max_rank >= 0 ? cfg.band_max_rank : k - 1) \
    X(budget_mass,        FLOAT, cfg.budget_mass) \
    X(renorm,             BOOL,  cfg.renorm) \
    X(light,              NAME,  cfg.light_host ? "host" : "substitute") \
    X(prefetch,           BOOL,  cfg.prefetch) \
    X(prefetch_max,       INT,   cfg.prefetch_max > 0 ? cfg.prefetch_max : k) \
    X(slots,              INT,   n_slots) \
    X(n_expert,           INT,   n_expert) \
    X(n_expert_used,      INT,   k) \
    X(profile,            STR,   cfg.profile)

// The "config" block's members, one per line with `indent` before each (no braces)
std::string llama_expert_cache_config_json(const llama_expert_cache_config & cfg, int32_t n_expert, int32_t k,
                                           int32_t n_slots, const char * indent);

// A string as a JSON string (quotes, escapes)
std::string llama_expert_json_str(const std::string & s);

// Parse a spec such as "mode=emulate,policy=quality,slots=25%".
// Returns false and sets err (naming the bad key and the accepted values) on error.
bool llama_expert_cache_config_parse(const std::string & spec, llama_expert_cache_config & cfg, std::string & err);

// The number of slots per layer for a layer with n_expert experts.
int32_t llama_expert_cache_config_n_slots(const llama_expert_cache_config & cfg, int32_t n_expert);

// The RAM tier's slots per layer (three tiers); 0: none.
int32_t llama_expert_cache_config_n_ram_slots(const llama_expert_cache_config & cfg, int32_t n_expert);

// The checks that need the model's experts per token k and experts per layer: j <= k, k <= m <= n_expert,
// kmin <= k, min_rank <= k, max_rank < k. Returns false and sets err (one line naming the key and the accepted range) on error.
bool llama_expert_cache_config_check_k(const llama_expert_cache_config & cfg, int32_t k, int32_t n_expert, std::string & err);

// Whether the rule can change the gate weights the expert ops use (drops, skips, alpha, renorm): the route step
// then multiplies them by the policy's per-rank factors (out_scale of decide()).
bool llama_expert_cache_config_scales_weights(const llama_expert_cache_config & cfg);

const char * llama_expert_evict_name(llama_expert_evict evict);
const char * llama_expert_cache_mode_name(llama_expert_cache_mode mode);
