#pragma once

// The miss rules of the expert residency policy (moe-subst): what a layer does with a selected expert that is not
// resident. The rules' table is in llama-expert-rules.cpp.
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

#include <cstdint>

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

const char * llama_expert_miss_rule_name(llama_expert_miss_rule rule);
