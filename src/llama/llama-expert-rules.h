#pragma once

// The miss rules of the expert residency policy (moe-subst): what a layer does with a selected expert that is not
// resident. One table (llama-expert-rules.cpp), one row per rule: its name, the spec keys it owns, what it can do
// (drop, substitute, scale gate weights) and its pure verdict. The spec parser's key checks, the policy's decision,
// the start-up log and the statistics read the table; tests/test_tables.py holds Python's rule list to it.
// To add a rule: an enum value, a row, its verdict, a unit test (docs/extending.md).
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
//   - rule=band with min_rank=R: ranks below R are fetched on a miss whatever their weight (min_rank=1: the
//     first choice is always fetched, so that a band of light weights is told apart from the first choice).
//   - rule=band with max_rank=M: ranks above M are fetched on a miss whatever their weight (max_rank=0: only a
//     first choice is ever substituted, the study's light first choices `rule=band,hi=H,max_rank=0`).
//   - rule=budget (the study's mass hypothesis as a rule; issue 37): per token and MoE layer (each layer decides its
//     own), its misses from the lightest up are
//     substituted while their summed gate weight stays <= `mass` (default 0.1), the first that would exceed it and
//     every heavier one fetched. A token-level verdict: the policy's decide() spends the budget (the row's verdict,
//     FETCH, is what a miss gets once the budget is spent).
//   - light=host (rules that substitute): a light miss, one the rule does not fetch by its rank or weight (which

#include "llama-expert-params.h"

#include <cstdint>
#include <string>

enum llama_expert_miss_rule {
    LLAMA_EXPERT_MISS_FETCH_ALL      = 0, // fetch every miss
    LLAMA_EXPERT_MISS_THRESHOLD      = 1, // fetch rank 0 or gate weight >= tau, substitute the rest
    LLAMA_EXPERT_MISS_FIRST_CHOICE   = 2, // fetch only a missed rank 0, substitute the rest
    LLAMA_EXPERT_MISS_SUBSTITUTE_ALL = 3, // substitute every miss
    LLAMA_EXPERT_MISS_DROP           = 4, // give every miss gate weight 0 (a reference point)
    LLAMA_EXPERT_MISS_CACHE_ROUTE    = 5, // colibri CACHE_ROUTE: ranks < j fetched, later ones a resident of the top m
    LLAMA_EXPERT_MISS_ZERO           = 6, // colibri DEGRADE_ZERO: drop a miss with gate weight < tau, fetch the others
    LLAMA_EXPERT_MISS_SER            = 7, // ik_llama.cpp SER: skip ranks >= kmin unless w > t * w_0 (cache-unaware)
    LLAMA_EXPERT_MISS_BAND           = 8, // substitute a miss with gate weight in [lo, hi) at ranks in [min_rank, max_rank], fetch the others
    LLAMA_EXPERT_MISS_BUDGET         = 9, // a token's lightest misses substituted while their summed weight <= mass, the rest fetched
};

const char * llama_expert_miss_rule_name(llama_expert_miss_rule rule);

// what a rule does with one selected expert that is not resident
enum llama_expert_verdict {
    LLAMA_EXPERT_VERDICT_FETCH      = 0, // copy it into a slot (or read it from the file) and compute with it
    LLAMA_EXPERT_VERDICT_SUBSTITUTE = 1, // compute with a resident expert instead (a light miss)
    LLAMA_EXPERT_VERDICT_DROP       = 2, // gate weight 0
    LLAMA_EXPERT_VERDICT_HOST       = 3, // compute the missed expert on the host (a light miss with light=host)
};

// One row of the rule table.
struct llama_expert_rule {
    llama_expert_miss_rule id;
    const char * name;   // rule=<name>
    const char * keys;   // the spec keys only this rule (or its family) takes, comma-separated; "" none
    const char * shown;  // how an error names it beside rule=<name>, e.g. " (policy=quality)"; "" none
    bool drops;          // it can drop a miss or skip a selection (renorm applies; the gate weights are scaled)
    bool substitutes;    // it can substitute a miss (light applies)
    bool windowed;       // substitutes come from the router's top m, their weight times alpha (cache-route)

    // the verdict on a miss at rank `rank` with normalised gate weight w; from_file: the miss is read from the model
    // file (host=file, not in the RAM tier); FETCH, SUBSTITUTE or DROP (light=host is applied by
    // llama_expert_rule_verdict)
    llama_expert_verdict (*miss)(int32_t rank, float w, bool from_file, const llama_expert_params & p);

    // whether a selection at rank `rank` is skipped before the residency is looked at (cache-unaware rules: gate
    // weight 0, resident or not); w0: the rank-0 weight. Null: never
    bool (*skip)(int32_t rank, float w, float w0, const llama_expert_params & p);

    // the start-up log's line for the rule's parameters (k: experts used per token); null: renorm for a rule
    // that drops, the light misses' fate for one that substitutes (only when light=host)
    std::string (*describe)(const llama_expert_params & p, int32_t k, int32_t n_expert);
};

// the table, in enum order
extern const llama_expert_rule LLAMA_EXPERT_RULES[];
extern const int32_t           LLAMA_EXPERT_N_RULES;

const llama_expert_rule & llama_expert_rule_of(llama_expert_miss_rule rule);
const llama_expert_rule * llama_expert_rule_find(const char * name); // null: no such rule

// whether `key` is one of the rule's own keys
bool llama_expert_rule_owns(const llama_expert_rule & r, const char * key);

// the start-up log's line for the rule (empty: nothing to say)
std::string llama_expert_rule_describe(const llama_expert_rule & r, const llama_expert_params & p, int32_t k,
                                       int32_t n_expert);

// the rule's verdict on a miss, light=host applied (a SUBSTITUTE becomes HOST)
llama_expert_verdict llama_expert_rule_verdict(const llama_expert_rule & r, int32_t rank, float w, bool from_file,
                                               const llama_expert_params & p);
