#include "llama-expert-rules.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>

//
// verdicts: pure functions of the rank, the gate weight, the tier and the parameters
//

static llama_expert_verdict fetch_all(int32_t, float, bool, const llama_expert_params &) {
    return LLAMA_EXPERT_VERDICT_FETCH;
}

// fetch rank 0 or a gate weight >= tau (the model file's tau_file for a miss read from the file), substitute the rest
static llama_expert_verdict threshold(int32_t rank, float w, bool from_file, const llama_expert_params & p) {
    return rank == 0 || w >= (from_file ? p.tau_file : p.tau) ? LLAMA_EXPERT_VERDICT_FETCH : LLAMA_EXPERT_VERDICT_SUBSTITUTE;
}

static llama_expert_verdict first_choice(int32_t rank, float, bool, const llama_expert_params &) {
    return rank == 0 ? LLAMA_EXPERT_VERDICT_FETCH : LLAMA_EXPERT_VERDICT_SUBSTITUTE;
}

static llama_expert_verdict substitute_all(int32_t, float, bool, const llama_expert_params &) {
    return LLAMA_EXPERT_VERDICT_SUBSTITUTE;
}

static llama_expert_verdict drop(int32_t, float, bool, const llama_expert_params &) {
    return LLAMA_EXPERT_VERDICT_DROP;
}

// colibri's CACHE_ROUTE: ranks below j fetched, later ones substituted (from the router's top m)
static llama_expert_verdict cache_route(int32_t rank, float, bool, const llama_expert_params & p) {
    return rank < p.route_j ? LLAMA_EXPERT_VERDICT_FETCH : LLAMA_EXPERT_VERDICT_SUBSTITUTE;
}

// colibri's DEGRADE_ZERO: a miss below tau dropped, the others fetched
static llama_expert_verdict zero(int32_t, float w, bool, const llama_expert_params & p) {
    return w < p.tau ? LLAMA_EXPERT_VERDICT_DROP : LLAMA_EXPERT_VERDICT_FETCH;
}

// SER: a computed miss is fetched (the rule acts before the residency: ser_skip)
static llama_expert_verdict ser(int32_t, float, bool, const llama_expert_params &) {
    return LLAMA_EXPERT_VERDICT_FETCH;
}

// ik_llama.cpp's SER: a rank after the first kmin runs only if its weight is > t * the first choice's
static bool ser_skip(int32_t rank, float w, float w0, const llama_expert_params & p) {
    return rank >= p.ser_kmin && !(w > p.ser_t * w0);
}

// Experiment B: a miss with gate weight in [lo, hi) at a rank in [min_rank, max_rank] substituted (hi = 1: no upper
// bound; max_rank < 0: no last rank), every other miss fetched
static llama_expert_verdict band(int32_t rank, float w, bool, const llama_expert_params & p) {
    const bool in_band  = w >= p.band_lo && (w < p.band_hi || p.band_hi >= 1.0f);
    const bool in_ranks = rank >= p.band_min_rank && (p.band_max_rank < 0 || rank <= p.band_max_rank);
    return in_ranks && in_band ? LLAMA_EXPERT_VERDICT_SUBSTITUTE : LLAMA_EXPERT_VERDICT_FETCH;
}

// the budget rule's verdict once a token's budget is spent (the policy spends it: llama-expert-policy.cpp)
static llama_expert_verdict budget(int32_t, float, bool, const llama_expert_params &) {
    return LLAMA_EXPERT_VERDICT_FETCH;
}

//
// the start-up log's lines of the rules with parameters of their own
//

static std::string describe_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

static std::string describe_cache_route(const llama_expert_params & p, int32_t k, int32_t n_expert) {
    return describe_format("cache-route: ranks < %d always computed, substitutes from the router's top %d, alpha = %.3f, "
        "light misses %s", p.route_j, p.route_m > 0 ? p.route_m : std::min(n_expert, 2*k), p.route_alpha,
        p.light_host ? "on the host" : "substituted");
}

static std::string describe_budget(const llama_expert_params & p, int32_t, int32_t) {
    return describe_format("budget: per token, the lightest misses substituted while their summed gate weight stays "
        "<= %.3f, the others fetched; light misses %s", p.budget_mass, p.light_host ? "on the host" : "substituted");
}

static std::string describe_ser(const llama_expert_params & p, int32_t, int32_t) {
    return describe_format("ser: kmin = %d, t = %.3f, renorm = %s", p.ser_kmin, p.ser_t, p.renorm ? "on" : "off");
}

static std::string describe_band(const llama_expert_params & p, int32_t, int32_t) {
    const std::string lo = std::to_string(p.band_min_rank), hi = std::to_string(p.band_max_rank);
    const std::string ranks =
        p.band_max_rank == p.band_min_rank ? "at rank " + lo + " only" :
        p.band_max_rank >= 0 ? (p.band_min_rank > 0 ? "at ranks " + lo + " to " + hi : "at ranks <= " + hi) :
        p.band_min_rank > 0  ? "at ranks >= " + lo : "at any rank";
    return describe_format("band: misses with gate weight in [%.3f, %s) substituted %s, the others fetched%s", p.band_lo,
        p.band_hi >= 1.0f ? "1]" : std::to_string(p.band_hi).c_str(), ranks.c_str(),
        p.light_host ? " (light=host: computed on the host)" : "");
}

//
// the table: one row per rule, in enum order
//

const llama_expert_rule LLAMA_EXPERT_RULES[] = {
    // id                                name              keys              shown                drops  subst  window verdict         skip      describe
    { LLAMA_EXPERT_MISS_FETCH_ALL,      "fetch-all",      "",               "",                  false, false, false, fetch_all,      nullptr,  nullptr              },
    { LLAMA_EXPERT_MISS_THRESHOLD,      "threshold",      "tau,tau_file",   " (policy=quality)", false, true,  false, threshold,      nullptr,  nullptr              },
    { LLAMA_EXPERT_MISS_FIRST_CHOICE,   "first-choice",   "",               "",                  false, true,  false, first_choice,   nullptr,  nullptr              },
    { LLAMA_EXPERT_MISS_SUBSTITUTE_ALL, "substitute-all", "",               "",                  false, true,  false, substitute_all, nullptr,  nullptr              },
    { LLAMA_EXPERT_MISS_DROP,           "drop",           "",               "",                  true,  false, false, drop,           nullptr,  nullptr              },
    { LLAMA_EXPERT_MISS_CACHE_ROUTE,    "cache-route",    "j,m,alpha",      "",                  false, true,  true,  cache_route,    nullptr,  describe_cache_route },
    { LLAMA_EXPERT_MISS_ZERO,           "zero",           "tau",            "",                  true,  false, false, zero,           nullptr,  nullptr              },
    { LLAMA_EXPERT_MISS_SER,            "ser",            "kmin,t",         "",                  true,  false, false, ser,            ser_skip, describe_ser         },
    { LLAMA_EXPERT_MISS_BAND,           "band",           "lo,hi,min_rank,max_rank", "",         false, true,  false, band,           nullptr,  describe_band        },
    { LLAMA_EXPERT_MISS_BUDGET,         "budget",         "mass",           "",                  false, true,  false, budget,         nullptr,  describe_budget      },
};

const int32_t LLAMA_EXPERT_N_RULES = (int32_t) (sizeof(LLAMA_EXPERT_RULES) / sizeof(LLAMA_EXPERT_RULES[0]));

const llama_expert_rule & llama_expert_rule_of(llama_expert_miss_rule rule) {
    for (int32_t i = 0; i < LLAMA_EXPERT_N_RULES; ++i) {
        if (LLAMA_EXPERT_RULES[i].id == rule) {
            return LLAMA_EXPERT_RULES[i];
        }
    }
    return LLAMA_EXPERT_RULES[0]; // not reached: every enum value has a row (tests/cpp/test_expert_policy.cpp)
}

const llama_expert_rule * llama_expert_rule_find(const char * name) {
    for (int32_t i = 0; i < LLAMA_EXPERT_N_RULES; ++i) {
        if (strcmp(LLAMA_EXPERT_RULES[i].name, name) == 0) {
            return &LLAMA_EXPERT_RULES[i];
        }
    }
    return nullptr;
}

bool llama_expert_rule_owns(const llama_expert_rule & r, const char * key) {
    const size_t n = strlen(key);
    for (const char * k = r.keys; *k; ) {
        const char * end = strchr(k, ',');
        const size_t len = end ? (size_t) (end - k) : strlen(k);
        if (len == n && strncmp(k, key, n) == 0) {
            return true;
        }
        k += len + (end ? 1 : 0);
    }
    return false;
}

std::string llama_expert_rule_describe(const llama_expert_rule & r, const llama_expert_params & p, int32_t k,
                                       int32_t n_expert) {
    if (r.describe) {
        return r.describe(p, k, n_expert);
    }
    if (r.drops) {
        return std::string("renorm = ") + (p.renorm ? "on" : "off");
    }
    if (r.substitutes && p.light_host) {
        return "light misses computed on the host";
    }
    return "";
}

llama_expert_verdict llama_expert_rule_verdict(const llama_expert_rule & r, int32_t rank, float w, bool from_file,
                                               const llama_expert_params & p) {
    const llama_expert_verdict v = r.miss(rank, w, from_file, p);
    return v == LLAMA_EXPERT_VERDICT_SUBSTITUTE && p.light_host ? LLAMA_EXPERT_VERDICT_HOST : v;
}

const char * llama_expert_miss_rule_name(llama_expert_miss_rule rule) {
    for (int32_t i = 0; i < LLAMA_EXPERT_N_RULES; ++i) {
        if (LLAMA_EXPERT_RULES[i].id == rule) {
            return LLAMA_EXPERT_RULES[i].name;
        }
    }
    return "?";
}
