#pragma once

// The parameters a layer's residency policy decides with (moe-subst), resolved once from the configuration
// (llama_expert_cache_config_params, llama-expert-spec.h): the miss rules' verdicts read them (llama-expert-rules.h),
// every layer policy holds one copy. No includes of ours: the lowest room of the policy.

#include <cstdint>

enum llama_expert_evict {
    LLAMA_EXPERT_EVICT_LFU = 0,
    LLAMA_EXPERT_EVICT_LRU = 1,
    LLAMA_EXPERT_EVICT_CLASSLRU = 2, // upstream llama.cpp's ClassLRU: decayed-count classes, an LRU order in each
};

struct llama_expert_params {
    // rule=threshold: the threshold for a miss copied from memory (host=ram, or held by the RAM tier), and for a miss
    // read from the model file (host=file: tau_file, or tau when not given); rule=zero: tau
    float    tau      = 0.15f;
    float    tau_file = 0.15f;
    bool     host_file = false;
    llama_expert_evict evict = LLAMA_EXPERT_EVICT_LRU;
    bool     admit = false;
    float    beta  = 0.5f;
    uint32_t lfu_halve          = 1024;
    uint32_t classlru_half_life = 128;
    uint32_t classlru_classes   = 8;
    int32_t  route_j     = 1;
    int32_t  route_m     = 0; // 0: 2k
    float    route_alpha = 1.0f;
    int32_t  ser_kmin    = 1;
    float    ser_t       = 0.1f;
    float    band_lo       = 0.0f;
    float    band_hi       = 1.0f;
    int32_t  band_min_rank = 0;
    int32_t  band_max_rank = -1; // -1: no last rank
    float    budget_mass   = 0.1f; // rule=budget: the gate weight a token's substituted misses may sum to
    bool     renorm     = false;
    bool     light_host = false;
    bool     prefetch   = false;
    int32_t  prefetch_max = 0; // prefetch=on: at most this many experts admitted per prediction (0: all k)
};
