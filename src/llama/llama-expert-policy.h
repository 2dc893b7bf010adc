#pragma once

// Expert residency policy for Mixture-of-Experts layers (moe-subst).
//
// Pure host-side logic with no ggml graph dependency, so that it can be unit tested alone and
// replayed by a simulator on recorded router traces:
//   - the configuration (one spec string, parsed in one place),
//   - per MoE layer: a residency table (expert <-> slot), the miss rules, the substitute choice,
//     eviction (LFU with periodic halving, LRU, or ClassLRU), background admission, and statistics.
//
// Decisions are taken token by token in decode order and, within a token, rank by rank.
//
// The anchors' policies (docs/expert-cache.md "The anchors' policies"; implemented from their descriptions in
// the moe-subst design notes, not from their code):
//   - evict=classlru, upstream llama.cpp's expert cache eviction (PR #31233): every expert of a layer has a use
//     count, +1 per router selection, decaying with a half-life of `half_life` tokens of the layer (default 128)
//     and kept for non-resident experts too (ghost history: an evicted expert that comes back keeps its
//     count). Its class is floor(log2(count)) clamped to [0, classes - 1] (default 8 classes; a count below 2 is
//     class 0). One LRU order per class; the victim is a free slot, else, among the least recently used
//     evictable expert of each class, the one with the largest age / 2^class (age: tokens of the layer since
//     its last use; ties: the lower class, then the lowest id).
//   - rule=cache-route, colibri's CACHE_ROUTE: ranks below `j` (default 1) are always computed (fetched on a
//     miss); a miss at a later rank takes the best-scored resident expert within the router's top `m`
//     (default 2k) that the token neither selected nor already used as a substitute, else it is fetched; a
//     substitute's gate weight is scaled by `alpha` (default 1).
//   - rule=zero, colibri's DEGRADE_ZERO: a miss with gate weight below `tau` (default 0.03) is dropped, the
//     others are fetched; `renorm=on` rescales the computed selections to the weight sum of all k.
//   - rule=ser, ik_llama.cpp's Smart Expert Reduction (-ser Kmin,t): cache-unaware: the first `kmin` ranks
//     (default 1) always run; a later rank runs only if its gate weight is > t * the rank-0 weight (default
//     t = 0.1); the others are skipped (gate weight 0, resident or not: `skips`); computed misses are fetched.
//   - rule=band (the study's Experiment B, one composition of substitutions at a time): a miss whose gate weight w
//     lies in [lo, hi) is substituted, at any rank (rank 0 included), every other miss is fetched; hi = 1 has no
//     upper bound (w = 1 is in the band). lo=0.3 substitutes only heavy misses, hi=0.05 only light ones.
//   - light=host (rules that substitute): a light miss, one the rule does not fetch by its rank or weight (which
//     it would otherwise substitute), is computed on the host with the missed expert itself (exact;
//     LLAMA_EXPERT_ACTION_HOST, counter host_computes); with cache-route every rank from j on.

#include "llama-expert-counters.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

enum llama_expert_cache_mode {
    LLAMA_EXPERT_CACHE_MODE_OFF     = 0,
    LLAMA_EXPERT_CACHE_MODE_EMULATE = 1,
    LLAMA_EXPERT_CACHE_MODE_ENGINE  = 2, // real cache banks and copies (llama-expert-engine.h)
};

enum llama_expert_miss_rule {
    LLAMA_EXPERT_MISS_FETCH_ALL      = 0, // fetch every miss
    LLAMA_EXPERT_MISS_THRESHOLD      = 1, // fetch rank 0 or gate weight >= tau, substitute the rest
    LLAMA_EXPERT_MISS_FIRST_CHOICE   = 2, // fetch only a missed rank 0, substitute the rest
    LLAMA_EXPERT_MISS_SUBSTITUTE_ALL = 3, // substitute every miss
    LLAMA_EXPERT_MISS_DROP           = 4, // give every miss gate weight 0 (a reference point)
    LLAMA_EXPERT_MISS_CACHE_ROUTE    = 5, // colibri CACHE_ROUTE: ranks < j fetched, later ones a resident of the top m
    LLAMA_EXPERT_MISS_ZERO           = 6, // colibri DEGRADE_ZERO: drop a miss with gate weight < tau, fetch the others
    LLAMA_EXPERT_MISS_SER            = 7, // ik_llama.cpp SER: skip ranks >= kmin unless w > t * w_0 (cache-unaware)
    LLAMA_EXPERT_MISS_BAND           = 8, // substitute a miss with gate weight in [lo, hi) at any rank, fetch the others
};

enum llama_expert_evict {
    LLAMA_EXPERT_EVICT_LFU = 0,
    LLAMA_EXPERT_EVICT_LRU = 1,
    LLAMA_EXPERT_EVICT_CLASSLRU = 2, // upstream llama.cpp's ClassLRU: decayed-count classes, an LRU order in each
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

// what happened to one selected expert of one token
enum llama_expert_action {
    LLAMA_EXPERT_ACTION_HIT        = 0,
    LLAMA_EXPERT_ACTION_FETCH      = 1,
    LLAMA_EXPERT_ACTION_SUBSTITUTE = 2,
    LLAMA_EXPERT_ACTION_DROP       = 3, // gate weight 0 (a dropped miss, or a selection skipped by rule=ser)
    LLAMA_EXPERT_ACTION_HOST       = 4, // computed on the host with the missed expert itself (light=host; exact)
};

#define LLAMA_EXPERT_MASS_HIST_BINS 20

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
    float band_lo = 0.0f;
    float band_hi = 1.0f;

    // rules that drop (drop, zero, ser): rescale the computed selections to the weight sum of all k (renorm=on)
    bool renorm = false;

    // rules that substitute: a light miss (not fetched by rank or weight) is computed on the host (light=host)
    bool light_host = false;

    // prefetch=on: the next MoE layer's router applied to this layer's input predicts that layer's k experts; the
    // predicted ones that are not resident are admitted in the background before that layer decides the token
    bool prefetch = false;

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

    std::string off_ignored; // mode=off: the other keys given, which have no effect (a warning names them)

    std::string profile;     // initial residency from a profile file (see profile_out)
    std::string profile_out; // write per-layer expert selection counts at the end
    std::string stats;       // write statistics as JSON at the end
    std::string trace;       // write a binary router trace
    uint32_t    trace_top = 16; // router probabilities kept per token and layer in the trace
};

// Parse a spec such as "mode=emulate,policy=quality,slots=25%".
// Returns false and sets err (naming the bad key and the accepted values) on error.
bool llama_expert_cache_config_parse(const std::string & spec, llama_expert_cache_config & cfg, std::string & err);

// The number of slots per layer for a layer with n_expert experts.
int32_t llama_expert_cache_config_n_slots(const llama_expert_cache_config & cfg, int32_t n_expert);

// The RAM tier's slots per layer (three tiers); 0: none.
int32_t llama_expert_cache_config_n_ram_slots(const llama_expert_cache_config & cfg, int32_t n_expert);

// The checks that need the model's experts per token k and experts per layer: j <= k, k <= m <= n_expert,
// kmin <= k. Returns false and sets err (one line naming the key and the accepted range) on error.
bool llama_expert_cache_config_check_k(const llama_expert_cache_config & cfg, int32_t k, int32_t n_expert, std::string & err);

// Whether the rule can change the gate weights the expert ops use (drops, skips, alpha, renorm): the route step
// then multiplies them by the policy's per-rank factors (out_scale of decide()).
bool llama_expert_cache_config_scales_weights(const llama_expert_cache_config & cfg);

const char * llama_expert_miss_rule_name(llama_expert_miss_rule rule);
const char * llama_expert_evict_name(llama_expert_evict evict);
const char * llama_expert_cache_mode_name(llama_expert_cache_mode mode);

struct llama_expert_policy_stats {
    // calls, hits, misses, fetches, substitutions, ...: the counter table in llama-expert-counters.h
#define LLAMA_EXPERT_COUNTER_ZERO(field, metric, help) uint64_t field = 0;
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_ZERO)
    double   subst_mass_sum          = 0.0; // sum over token-layers of the substituted gate mass
    double   drop_mass_sum           = 0.0;
    float    max_subst_weight        = 0.0f;
    uint64_t mass_hist[LLAMA_EXPERT_MASS_HIST_BINS] = {}; // token-layers by substituted mass, bins of 1/N

    void add(const llama_expert_policy_stats & other);
};

// The policy state of one MoE layer.
struct llama_expert_layer_policy {
    void init(int32_t n_expert, int32_t n_slots, const llama_expert_cache_config & cfg);

    // initial residency from per-expert counts (the n_slots most used, ties: lowest id); null: first n_slots
    void set_initial(const std::vector<uint64_t> * counts);

    // back to the initial residency, clear counters, accumulators and statistics
    void reset();

    // Decide one token. ids: the k selected experts in router order (rank 0 first); w: their normalised
    // gate weights; scores: router scores of all n_expert experts (only their order matters; used to
    // choose substitutes). Writes the expert id to compute with (out_ids) and the action per rank, and when
    // out_scale is not null the factor per rank for the gate weight the graph uses (0 for a drop or a skip,
    // alpha for a cache-route substitute, the renorm factor for a computed selection with renorm=on, else 1).
    void decide(const int32_t * ids, const float * w, int32_t k, const float * scores,
                int32_t * out_ids, uint8_t * out_actions, float * out_scale = nullptr);

    // A group of tokens computed together from the cache banks (a small multi-token ubatch): between
    // begin_group() and end_group(), every expert a token of the group computes with stays resident until the
    // group ends (no later token of the group evicts it), so that all of them are in the banks at once.
    void begin_group();
    void end_group();

    // prefetch=on: admit the predicted experts ids[0..n) (rank order; -1 entries are skipped) that are not
    // resident, before the layer decides the token they were predicted for, as background admissions (the copy is
    // idealised: it completes before that decision). Victims by the eviction policy; never another expert of the
    // same prediction, nor one held by the current group. Returns the number admitted (counter prefetches; an
    // admitted expert counts prefetch_used when a token computes with it, prefetch_wasted when it is evicted first).
    int32_t prefetch_experts(const int32_t * ids, int32_t n);

    bool    is_resident(int32_t e) const { return slot_of[e] >= 0; }
    int32_t n_resident() const;

    int32_t n_expert = 0;
    int32_t n_slots  = 0;

    llama_expert_miss_rule rule  = LLAMA_EXPERT_MISS_FETCH_ALL;
    float                  tau   = 0.15f;
    llama_expert_evict     evict = LLAMA_EXPERT_EVICT_LRU;
    bool                   admit = false;
    float                  beta  = 0.5f;
    uint32_t               lfu_halve = 1024;
    uint32_t               classlru_half_life = 128;
    uint32_t               classlru_classes   = 8;
    int32_t                route_j     = 1;
    int32_t                route_m     = 0; // 0: 2k
    float                  route_alpha = 1.0f;
    int32_t                ser_kmin    = 1;
    float                  ser_t       = 0.1f;
    float                  band_lo     = 0.0f;
    float                  band_hi     = 1.0f;
    bool                   renorm      = false;
    bool                   light_host  = false;
    bool                   prefetch    = false;

    // choose substitutes from a per-token list of the best candidates (same result as a full scan per
    // substitution, which is what false does; kept for tests)
    bool fast_substitute = true;

    std::vector<int32_t> slot_of;   // expert -> slot, -1 if not resident
    std::vector<int32_t> expert_of; // slot -> expert, -1 if empty

    // three tiers: the RAM tier (n_ram slots; none when 0), LRU, inclusive of what was loaded through it
    int32_t               n_ram   = 0;
    float                 tau_ram = 0.15f; // rule=threshold: the threshold for misses the RAM tier holds
    std::vector<int32_t>  ram_of;     // expert -> RAM slot, -1
    std::vector<int32_t>  ram_expert; // RAM slot -> expert, -1
    std::vector<uint64_t> ram_last;   // tick of the last load or use of an expert in the RAM tier
    bool in_ram(int32_t e) const { return n_ram > 0 && ram_of[e] >= 0; }

    std::vector<uint32_t> use_count;  // LFU: router selections per expert (halved periodically)
    std::vector<uint64_t> last_use;   // LRU: tick of the last use of a resident expert
    std::vector<double>   admit_acc;  // admission: substituted gate mass per non-resident expert
    std::vector<uint64_t> sel_total;  // router selections per expert, never halved (for profiles)
    std::vector<double>   decay_count; // ClassLRU: decayed router selections per expert, as of decay_tick
    std::vector<uint64_t> decay_tick;

    std::vector<int32_t> initial; // initial resident experts, by slot

    llama_expert_policy_stats stats;

    // per-token scratch
    uint64_t tick = 0;
    std::vector<uint64_t> sel_mark; // == tick: selected by the token being decided
    std::vector<uint64_t> sub_mark; // == tick: used as a substitute by the token being decided
    std::vector<uint64_t> hold_mark; // == group while in_group: computed with by a token of the current group
    uint64_t              group    = 0;
    bool                  in_group = false;
    std::vector<int32_t>  pending;  // experts to admit at the end of the token
    std::vector<uint8_t>  pf_unused; // 1: admitted by prefetch and not computed with yet
    std::vector<uint64_t> pf_mark;   // == pf_tick: predicted by the prefetch being applied
    uint64_t              pf_tick     = 0;
    bool                  in_prefetch = false;
    std::vector<int32_t>  cand;     // best-scored resident, non-selected experts of the token (built on demand)
    uint64_t              cand_tick = 0;
    std::vector<int32_t>  window;   // cache-route: the router's top m experts of the token, best first (on demand)
    uint64_t              window_tick = 0;

    // ClassLRU: the decayed count of expert e at the current tick, and its class
    double  classlru_count(int32_t e) const;
    int32_t classlru_class(int32_t e) const;

    // LFU and ClassLRU counts: n router selections of expert e at the current tick
    void count_use(int32_t e, double n);

private:
    int32_t find_slot(); // free slot or a victim not used by the current token; -1 if none
    bool    busy(int32_t e) const; // e may not be evicted now (used by the token, held by the group, predicted)
    void    ram_load(int32_t e);  // three tiers: e is loaded into a slot, from the RAM tier or through it
    void    ram_touch(int32_t e); // three tiers: e is used
    int32_t find_substitute(const float * scores, bool allow_reuse);
    int32_t find_route_substitute(const float * scores, int32_t k); // cache-route: within the top m, or -1
    void    place(int32_t e, int32_t slot);
};

// Profile files: per-layer expert selection counts, text, one line per layer:
//   moe-expert-profile 1
//   layer <il> <n_expert> <count_0> ... <count_{n_expert-1}>
bool llama_expert_profile_read(const std::string & path, std::vector<std::vector<uint64_t>> & counts, std::string & err);
bool llama_expert_profile_write(const std::string & path, const std::vector<const llama_expert_layer_policy *> & layers,
                                const std::vector<int32_t> & layer_ids);

// Prefill bypass (`bypass=N`): after a ubatch computed with stock routing, make the counts' n_slots most
// selected experts (counts > 0; ties: lowest id) resident, evicting experts outside that set (lowest count in
// the ubatch first, then least recently used). The ubatch's selections also count for LFU. No statistics.
void llama_expert_policy_warm(llama_expert_layer_policy & policy, const std::vector<uint32_t> & counts);
