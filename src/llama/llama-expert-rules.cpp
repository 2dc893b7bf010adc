#include "llama-expert-rules.h"

const char * llama_expert_miss_rule_name(llama_expert_miss_rule rule) {
    switch (rule) {
        case LLAMA_EXPERT_MISS_FETCH_ALL:      return "fetch-all";
        case LLAMA_EXPERT_MISS_THRESHOLD:      return "threshold";
        case LLAMA_EXPERT_MISS_FIRST_CHOICE:   return "first-choice";
        case LLAMA_EXPERT_MISS_SUBSTITUTE_ALL: return "substitute-all";
        case LLAMA_EXPERT_MISS_DROP:           return "drop";
        case LLAMA_EXPERT_MISS_CACHE_ROUTE:    return "cache-route";
        case LLAMA_EXPERT_MISS_ZERO:           return "zero";
        case LLAMA_EXPERT_MISS_SER:            return "ser";
        case LLAMA_EXPERT_MISS_BAND:           return "band";
    }
    return "?";
}
