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
// The miss rules: llama-expert-rules.h; the configuration: llama-expert-spec.h.

#include "llama-expert-counters.h"
#include "llama-expert-spec.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

// what happened to one selected expert of one token
enum llama_expert_action {
    LLAMA_EXPERT_ACTION_HIT        = 0,
    LLAMA_EXPERT_ACTION_FETCH      = 1,
    LLAMA_EXPERT_ACTION_SUBSTITUTE = 2,
    LLAMA_EXPERT_ACTION_DROP       = 3, // gate weight 0 (a dropped miss, or a selection skipped by rule=ser)
    LLAMA_EXPERT_ACTION_HOST       = 4, // computed on the host with the missed expert itself (light=host; exact)
};

#define LLAMA_EXPERT_MASS_HIST_BINS 20

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
    // prefetch_max=N: at most N admitted per prediction, the first non-resident ones in rank order (the highest
    // predicted scores, hence gate weights).
    int32_t prefetch_experts(const int32_t * ids, int32_t n);

    // host=file (the engine, llama-expert-engine.h): a prefetched expert whose read had not started when its layer
    // decided a ubatch that does not compute with it: its slot (and its RAM-tier slot, three tiers) is emptied, as if
    // the prefetch had not been made (counter prefetch_dropped; neither used nor wasted). False (nothing changed)
    // when e is not a resident prefetched expert that no token has computed with.
    bool drop_prefetched(int32_t e);

    // the residency, read-only: every change goes through the policy's own methods (place, ram_load, warm), which
    // keep the two maps of each tier inverse to each other
    bool    is_resident(int32_t e) const { return slot_by_expert[e] >= 0; }
    int32_t n_resident() const;
    int32_t slot_of(int32_t e) const { return slot_by_expert[e]; }   // expert -> slot, -1 if not resident
    int32_t expert_of(int32_t s) const { return expert_by_slot[s]; } // slot -> expert, -1 if empty
    const std::vector<int32_t> & experts() const { return expert_by_slot; }
    int32_t ram_slot_of(int32_t e) const { return n_ram > 0 ? ram_slot_by_expert[e] : -1; } // three tiers: -1 if not in RAM
    int32_t ram_expert_of(int32_t s) const { return expert_by_ram_slot[s]; }                // RAM slot -> expert, -1

    // Prefill bypass (`bypass=N`): after a ubatch computed with stock routing, make the counts' n_slots most
    // selected experts (counts > 0; ties: lowest id) resident, evicting experts outside that set (lowest count in
    // the ubatch first, then least recently used). The ubatch's selections also count for LFU. No statistics.
    void warm(const std::vector<uint32_t> & counts);

    int32_t n_expert = 0;
    int32_t n_slots  = 0;

    // the parameters, resolved once from the configuration (llama_expert_cache_config_params), and the rule's row
    const llama_expert_params & params() const { return par; }
    const llama_expert_rule   & rule() const { return *rule_row; }

    // choose substitutes from a per-token list of the best candidates (same result as a full scan per
    // substitution, which is what false does; kept for tests)
    bool fast_substitute = true;


    // three tiers: the RAM tier (n_ram slots; none when 0), LRU, inclusive of what was loaded through it
    int32_t               n_ram   = 0;
    std::vector<uint64_t> ram_last;   // tick of the last load or use of an expert in the RAM tier
    bool in_ram(int32_t e) const { return n_ram > 0 && ram_slot_by_expert[e] >= 0; }

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
    std::vector<uint8_t>  budget_sub;   // rule=budget: per rank of the token being decided, 1 = substitute its miss
    std::vector<int32_t>  budget_order; // rule=budget: the token's missed ranks, lightest first
    uint64_t              window_tick = 0;

    // ClassLRU: the decayed count of expert e at the current tick, and its class
    double  classlru_count(int32_t e) const;
    int32_t classlru_class(int32_t e) const;

    // LFU and ClassLRU counts: n router selections of expert e at the current tick
    void count_use(int32_t e, double n);

private:
    llama_expert_params       par;
    const llama_expert_rule * rule_row = &LLAMA_EXPERT_RULES[0];

    std::vector<int32_t> slot_by_expert;     // expert -> slot, -1 if not resident
    std::vector<int32_t> expert_by_slot;     // slot -> expert, -1 if empty
    std::vector<int32_t> ram_slot_by_expert; // three tiers: expert -> RAM slot, -1
    std::vector<int32_t> expert_by_ram_slot; // three tiers: RAM slot -> expert, -1

    int32_t find_slot(); // free slot or a victim not used by the current token; -1 if none
    bool    busy(int32_t e) const; // e may not be evicted now (used by the token, held by the group, predicted)
    void    ram_load(int32_t e);  // three tiers: e is loaded into a slot, from the RAM tier or through it
    void    ram_touch(int32_t e); // three tiers: e is used
    int32_t find_substitute(const float * scores, bool allow_reuse);
    int32_t find_route_substitute(const float * scores, int32_t k); // cache-route: within the top m, or -1
    void    place(int32_t e, int32_t slot);
    // the parts of decide: one miss, the scales of drops and renorm, the admissions, the token's statistics
    void    spend_budget(const int32_t * ids, const float * w, int32_t k); // rule=budget: fills budget_sub
    void    decide_miss(int32_t r, int32_t e, const float * w, const float * scores, int32_t k, int32_t * out_ids,
                        uint8_t * out_actions, float * out_scale, double & mass, double & drop_mass);
    void    apply_scales(const float * w, int32_t k, const uint8_t * out_actions, float * out_scale);
    void    admit_pending();
    void    count_token(double mass, double drop_mass);
};

// Prefill bypass (`bypass=N`): after a ubatch computed with stock routing, make the counts' n_slots most
// selected experts (counts > 0; ties: lowest id) resident, evicting experts outside that set (lowest count in
// the ubatch first, then least recently used). The ubatch's selections also count for LFU. No statistics.
inline void llama_expert_policy_warm(llama_expert_layer_policy & policy, const std::vector<uint32_t> & counts) {
    policy.warm(counts);
}
