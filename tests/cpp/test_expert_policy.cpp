// Unit tests of the moe-subst expert residency policy (src/llama/llama-expert-policy.cpp).
// Built and run by tests/test_expert_cache.py:  c++ -std=c++17 -O1 -Isrc/llama -Isrc/include this.cpp src/llama/llama-expert-policy.cpp
#include "llama-expert-policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

static int n_fail = 0;

#define CHECK(cond) do { if (!(cond)) { std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); ++n_fail; } } while (0)

static llama_expert_cache_config cfg_of(const std::string & spec) {
    llama_expert_cache_config cfg;
    std::string err;
    if (!llama_expert_cache_config_parse(spec, cfg, err)) {
        std::fprintf(stderr, "parse failed for '%s': %s\n", spec.c_str(), err.c_str());
        std::exit(2);
    }
    return cfg;
}

struct step_result {
    std::vector<int32_t> out;
    std::vector<uint8_t> act;
};

static step_result step(llama_expert_layer_policy & p, std::vector<int32_t> ids, std::vector<float> w, const std::vector<float> & scores) {
    step_result r;
    r.out.resize(ids.size());
    r.act.resize(ids.size());
    p.decide(ids.data(), w.data(), (int32_t) ids.size(), scores.data(), r.out.data(), r.act.data());
    return r;
}

static void test_parse() {
    llama_expert_cache_config cfg;
    std::string err;

    CHECK(llama_expert_cache_config_parse("", cfg, err) && cfg.mode == LLAMA_EXPERT_CACHE_MODE_OFF);
    CHECK(llama_expert_cache_config_parse("mode=off", cfg, err) && cfg.mode == LLAMA_EXPERT_CACHE_MODE_OFF);

    CHECK(llama_expert_cache_config_parse("mode=emulate,policy=quality,slots=25%", cfg, err));
    CHECK(cfg.mode == LLAMA_EXPERT_CACHE_MODE_EMULATE && cfg.rule == LLAMA_EXPERT_MISS_THRESHOLD);
    CHECK(cfg.evict == LLAMA_EXPERT_EVICT_LFU && cfg.admit && cfg.beta == 0.5f && std::fabs(cfg.tau - 0.15f) < 1e-7f);
    CHECK(llama_expert_cache_config_n_slots(cfg, 64) == 16 && llama_expert_cache_config_n_slots(cfg, 512) == 128);

    CHECK(llama_expert_cache_config_parse("policy=speed", cfg, err));
    CHECK(cfg.mode == LLAMA_EXPERT_CACHE_MODE_EMULATE && cfg.rule == LLAMA_EXPERT_MISS_FIRST_CHOICE && cfg.evict == LLAMA_EXPERT_EVICT_LFU && cfg.admit);

    CHECK(llama_expert_cache_config_parse("policy=fetch-all,slots=10", cfg, err));
    CHECK(cfg.rule == LLAMA_EXPERT_MISS_FETCH_ALL && cfg.evict == LLAMA_EXPERT_EVICT_LRU && !cfg.admit);
    CHECK(llama_expert_cache_config_n_slots(cfg, 64) == 10);

    // explicit keys override the preset, whatever their order
    CHECK(llama_expert_cache_config_parse("admit=off,policy=quality,tau=0.3,evict=lru", cfg, err));
    CHECK(cfg.rule == LLAMA_EXPERT_MISS_THRESHOLD && !cfg.admit && std::fabs(cfg.tau - 0.3f) < 1e-7f && cfg.evict == LLAMA_EXPERT_EVICT_LRU);
    CHECK(llama_expert_cache_config_parse("rule=substitute-all,admit=0.75,halve=0", cfg, err));
    CHECK(cfg.rule == LLAMA_EXPERT_MISS_SUBSTITUTE_ALL && cfg.admit && cfg.beta == 0.75f && cfg.lfu_halve == 0);

    // errors name the key and the accepted values
    CHECK(!llama_expert_cache_config_parse("mode=emulate,colour=red", cfg, err) && err.find("'colour'") != std::string::npos &&
          err.find("slots") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("mode=bogus", cfg, err) && err.find("'mode'") != std::string::npos &&
          err.find("off, emulate, engine") != std::string::npos);
    CHECK(llama_expert_cache_config_parse("mode=engine,policy=quality", cfg, err) &&
          cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE);
    CHECK(!llama_expert_cache_config_parse("policy=fast", cfg, err) && err.find("quality, speed, fetch-all") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("slots=0", cfg, err) && err.find("'slots'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("slots=120%", cfg, err) && err.find("'slots'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("tau=abc", cfg, err) && err.find("'tau'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=maybe", cfg, err) && err.find("first-choice") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("emulate,garbage", cfg, err) && err.find("'garbage'") != std::string::npos);
}

// admission fires exactly when the accumulated substituted mass reaches beta
static void test_admission() {
    for (int variant = 0; variant < 2; ++variant) {
        llama_expert_layer_policy p;
        p.init(8, 3, cfg_of("rule=substitute-all,evict=lru,admit=0.5,slots=3"));
        // resident: 0, 1, 2. Scores make 1 the best substitute and 2 the worst.
        std::vector<float> scores = { 0.5f, 0.9f, 0.1f, 0, 0, 0.3f, 0, 0 };
        const std::vector<float> wmiss = variant == 0 ? std::vector<float>{ 0.25f, 0.25f } : std::vector<float>{ 0.2f, 0.2f, 0.2f };
        for (size_t t = 0; t < wmiss.size(); ++t) {
            auto r = step(p, { 5, 0 }, { wmiss[t], 1.0f - wmiss[t] }, scores);
            CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[0] == 1);
            CHECK(r.act[1] == LLAMA_EXPERT_ACTION_HIT && r.out[1] == 0);
            const bool last = t + 1 == wmiss.size();
            CHECK(p.is_resident(5) == last);
            CHECK(p.stats.admissions == (last ? 1u : 0u));
        }
        // the victim was the only expert not used by that token: 2; the admission reset the accumulator
        CHECK(!p.is_resident(2) && p.is_resident(0) && p.is_resident(1));
        CHECK(p.admit_acc[5] == 0.0);
        CHECK(p.stats.evictions == 1);
        auto r = step(p, { 5, 0 }, { 0.25f, 0.75f }, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_HIT && r.out[0] == 5);
    }
    // admit=off: never admitted
    llama_expert_layer_policy p;
    p.init(8, 3, cfg_of("rule=substitute-all,admit=off,slots=3"));
    std::vector<float> scores(8, 0.0f);
    for (int t = 0; t < 10; ++t) {
        step(p, { 5, 0 }, { 0.5f, 0.5f }, scores);
    }
    CHECK(!p.is_resident(5) && p.stats.admissions == 0);
}

static void test_lfu_lru() {
    const std::vector<float> scores(6, 0.0f);
    // k = 1; resident 0, 1, 2; uses 0,0,0,1,1,2 then misses on 3 and 4
    {
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lfu,halve=0,slots=3"));
        for (int e : { 0, 0, 0, 1, 1, 2 }) {
            CHECK(step(p, { e }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_HIT);
        }
        CHECK(step(p, { 3 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(!p.is_resident(2) && p.is_resident(0) && p.is_resident(1) && p.is_resident(3)); // 2 was used once
        step(p, { 4 }, { 1.0f }, scores);
        CHECK(!p.is_resident(3) && p.is_resident(0) && p.is_resident(1) && p.is_resident(4)); // 3: once, later than 2
        CHECK(p.stats.evictions == 2 && p.stats.fetches == 2 && p.stats.hits == 6);
    }
    {
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lru,slots=3"));
        for (int e : { 0, 0, 0, 1, 1, 2 }) {
            step(p, { e }, { 1.0f }, scores);
        }
        step(p, { 3 }, { 1.0f }, scores);
        CHECK(!p.is_resident(0) && p.is_resident(1) && p.is_resident(2) && p.is_resident(3)); // 0: least recently used
        step(p, { 4 }, { 1.0f }, scores);
        CHECK(!p.is_resident(1) && p.is_resident(2) && p.is_resident(3) && p.is_resident(4));
    }
    // LFU with halving: counts of 8 and 1 become 4 and 0 after `halve` tokens
    {
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lfu,halve=9,slots=3"));
        for (int t = 0; t < 8; ++t) {
            step(p, { 0 }, { 1.0f }, scores);
        }
        CHECK(p.use_count[0] == 8);
        step(p, { 1 }, { 1.0f }, scores);
        CHECK(p.use_count[0] == 4 && p.use_count[1] == 0);
    }
    // never evict an expert selected by the token being decided: 0 is the LRU but selected by this token
    {
        llama_expert_layer_policy p;
        p.init(6, 2, cfg_of("rule=fetch-all,evict=lru,slots=2"));
        auto r = step(p, { 0, 5 }, { 0.6f, 0.4f }, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_HIT && r.act[1] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(p.is_resident(0) && p.is_resident(5) && !p.is_resident(1));
        // LFU likewise: 1 is used more than 0, yet 0 is selected by the token
        llama_expert_layer_policy q;
        q.init(6, 2, cfg_of("rule=fetch-all,evict=lfu,slots=2"));
        for (int t = 0; t < 3; ++t) {
            step(q, { 1 }, { 1.0f }, scores);
        }
        r = step(q, { 5, 0 }, { 0.5f, 0.5f }, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_HIT);
        CHECK(q.is_resident(0) && q.is_resident(5) && !q.is_resident(1));
    }
}

static void test_rules() {
    // 16 experts, resident 0..7; selected: 10 (rank 0), 11 (w 0.2), 12 (w 0.1), 3 (hit)
    std::vector<float> scores(16);
    for (int e = 0; e < 16; ++e) {
        scores[e] = 0.01f * e;
    }
    scores[6] = 0.5f; scores[2] = 0.5f; // tie: the lowest id wins
    const std::vector<int32_t> ids = { 10, 11, 12, 3 };
    const std::vector<float>   w   = { 0.5f, 0.2f, 0.1f, 0.2f };
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=threshold,tau=0.15,admit=off,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.out[0] == 10);
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_FETCH && r.out[1] == 11);
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[2] == 2); // best resident non-selected, tie -> lowest id
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_HIT && r.out[3] == 3);
        CHECK(std::fabs(p.stats.subst_mass_sum - 0.1) < 1e-6 && p.stats.subst_first_choice == 0);
    }
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=first-choice,admit=off,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[1] == 2);
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[2] == 6); // 2 already used as a substitute
    }
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=substitute-all,admit=off,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[0] == 2 && p.stats.subst_first_choice == 1);
        CHECK(p.stats.substitutions == 3 && p.stats.fetches == 0 && p.stats.max_subst_weight == 0.5f);
    }
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=drop,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_DROP && r.act[1] == LLAMA_EXPERT_ACTION_DROP && r.act[3] == LLAMA_EXPERT_ACTION_HIT);
        CHECK(p.stats.drops == 3 && p.n_resident() == 8 && !p.is_resident(10));
    }
    // initial residency from counts: the most used
    {
        llama_expert_layer_policy p;
        p.init(6, 2, cfg_of("slots=2"));
        std::vector<uint64_t> counts = { 1, 9, 3, 9, 0, 2 };
        p.set_initial(&counts);
        CHECK(p.is_resident(1) && p.is_resident(3) && p.n_resident() == 2);
    }
}

// random sequences: counters are consistent and the rules' invariants hold
static void test_random() {
    std::mt19937 rng(42);
    const char * specs[] = {
        "policy=quality,slots=16", "policy=speed,slots=16", "policy=fetch-all,slots=16",
        "rule=substitute-all,admit=off,slots=16", "rule=drop,slots=16", "rule=threshold,evict=lru,admit=0.3,slots=16",
    };
    for (const char * spec : specs) {
        const auto cfg = cfg_of(spec);
        llama_expert_layer_policy p;
        const int E = 64, k = 8;
        p.init(E, 16, cfg);
        std::vector<float> logits(E);
        uint64_t subst_fc = 0, subst_heavy = 0;
        for (int t = 0; t < 3000; ++t) {
            std::normal_distribution<float> nd(0.0f, 1.5f);
            for (int e = 0; e < E; ++e) {
                logits[e] = nd(rng) + (e % 7 == 0 ? 1.0f : 0.0f);
            }
            std::vector<int32_t> order(E);
            for (int e = 0; e < E; ++e) order[e] = e;
            std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
            std::vector<int32_t> ids(order.begin(), order.begin() + k);
            std::vector<float> w(k);
            float sum = 0;
            for (int r = 0; r < k; ++r) { w[r] = std::exp(logits[ids[r]]); sum += w[r]; }
            for (int r = 0; r < k; ++r) { w[r] /= sum; }
            auto res = step(p, ids, w, logits);
            for (int r = 0; r < k; ++r) {
                if (res.act[r] == LLAMA_EXPERT_ACTION_SUBSTITUTE) {
                    subst_fc    += r == 0;
                    subst_heavy += w[r] >= 0.15f;
                    // the substitute is not selected by the token
                    for (int q = 0; q < k; ++q) CHECK(res.out[r] != ids[q]);
                } else {
                    CHECK(res.out[r] == ids[r]);
                }
            }
            // all selected experts that were hit or fetched are resident after the token
            for (int r = 0; r < k; ++r) {
                if (res.act[r] == LLAMA_EXPERT_ACTION_HIT || res.act[r] == LLAMA_EXPERT_ACTION_FETCH) CHECK(p.is_resident(ids[r]));
            }
            CHECK(p.n_resident() == 16);
        }
        const auto & s = p.stats;
        CHECK(s.hits + s.misses == s.calls);
        CHECK(s.fetches + s.substitutions + s.drops == s.misses);
        CHECK(s.calls == 3000u * k && s.token_layers == 3000u);
        uint64_t hist = 0;
        for (auto c : s.mass_hist) hist += c;
        CHECK(hist == s.token_layers);
        CHECK(s.forced_substitutions == 0);
        if (cfg.rule == LLAMA_EXPERT_MISS_THRESHOLD) {
            CHECK(subst_fc == 0 && s.subst_first_choice == 0);
            if (cfg.tau == 0.15f) {
                CHECK(subst_heavy == 0 && s.max_subst_weight < 0.15f);
            }
            CHECK(s.substitutions > 0);
        }
        if (cfg.rule == LLAMA_EXPERT_MISS_FIRST_CHOICE) {
            CHECK(subst_fc == 0 && s.subst_first_choice == 0 && s.substitutions > 0);
        }
        if (cfg.rule == LLAMA_EXPERT_MISS_SUBSTITUTE_ALL) {
            CHECK(s.substitutions == s.misses && s.fetches == 0 && s.subst_first_choice > 0);
        }
        if (cfg.rule == LLAMA_EXPERT_MISS_FETCH_ALL) {
            CHECK(s.fetches == s.misses && s.substitutions == 0 && s.admissions == 0);
        }
        if (cfg.admit && cfg.rule != LLAMA_EXPERT_MISS_FETCH_ALL) {
            CHECK(s.admissions > 0);
        }
        std::printf("%-45s calls %llu hits %llu fetch %llu subst %llu drop %llu admit %llu evict %llu mass %.4f\n", spec,
            (unsigned long long) s.calls, (unsigned long long) s.hits, (unsigned long long) s.fetches,
            (unsigned long long) s.substitutions, (unsigned long long) s.drops, (unsigned long long) s.admissions,
            (unsigned long long) s.evictions, s.subst_mass_sum / s.token_layers);
        // reset: back to the initial residency
        p.reset();
        CHECK(p.stats.calls == 0 && p.n_resident() == 16);
        for (int e = 0; e < 16; ++e) CHECK(p.is_resident(e));
    }
}

// the per-token candidate list gives exactly the decisions of a full scan per substitution
static void test_fast_substitute() {
    const char * specs[] = {
        "policy=quality,slots=16", "policy=speed,slots=12", "rule=substitute-all,admit=off,slots=10",
        "rule=threshold,tau=0.05,evict=lru,admit=0.2,slots=9", "rule=first-choice,evict=lfu,admit=0.1,halve=64,slots=8",
    };
    for (const char * spec : specs) {
        const auto cfg = cfg_of(spec);
        const int E = 64, k = 8;
        llama_expert_layer_policy fast, slow;
        fast.init(E, llama_expert_cache_config_n_slots(cfg, E), cfg);
        slow.init(E, llama_expert_cache_config_n_slots(cfg, E), cfg);
        slow.fast_substitute = false;
        std::mt19937 rng(7);
        std::vector<float> logits(E);
        for (int t = 0; t < 4000; ++t) {
            for (int e = 0; e < E; ++e) {
                // coarse values: many ties, to exercise the lowest-id rule
                logits[e] = std::round(4.0f * std::normal_distribution<float>(0.0f, 1.0f)(rng)) / 4.0f;
            }
            std::vector<int32_t> order(E);
            for (int e = 0; e < E; ++e) order[e] = e;
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
            std::vector<int32_t> ids(order.begin(), order.begin() + k);
            std::vector<float> w(k);
            float sum = 0;
            for (int r = 0; r < k; ++r) { w[r] = std::exp(logits[ids[r]]); sum += w[r]; }
            for (int r = 0; r < k; ++r) { w[r] /= sum; }
            auto a = step(fast, ids, w, logits);
            auto b = step(slow, ids, w, logits);
            CHECK(a.out == b.out && a.act == b.act);
            if (a.out != b.out || a.act != b.act) {
                std::fprintf(stderr, "  %s: token %d differs\n", spec, t);
                break;
            }
        }
        CHECK(fast.expert_of == slow.expert_of);
        CHECK(fast.stats.substitutions == slow.stats.substitutions && fast.stats.substitutions > 0);
    }
}

// A group (a small multi-token ubatch computed from the banks together): no token of the group evicts an expert
// that an earlier token of the group computes with; outside a group, the same sequence does.
static void test_group() {
    const std::vector<float> scores(6, 0.0f);
    for (bool grouped : { false, true }) {
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lfu,halve=0,slots=3"));
        for (int t = 0; t < 3; ++t) {
            for (int e : { 0, 1, 2 }) {
                step(p, { e }, { 1.0f }, scores);
            }
        }
        if (grouped) {
            p.begin_group();
        }
        CHECK(step(p, { 3 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH); // evicts 0 (ties: LRU)
        CHECK(step(p, { 4 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH);
        if (grouped) {
            p.end_group();
            CHECK(p.is_resident(3) && p.is_resident(4)); // 3 (used once: the LFU victim) was held
        } else {
            CHECK(!p.is_resident(3) && p.is_resident(4));
        }
        // after the group, 3 is an ordinary resident expert again
        if (grouped) {
            step(p, { 5 }, { 1.0f }, scores);
            CHECK(!p.is_resident(3) || !p.is_resident(4));
        }
    }
    // random groups of up to n_slots / k tokens, every rule: every expert a token of the group computes with is
    // resident at the end of the group, so that the whole group can compute from the banks
    std::mt19937 rng(11);
    const int32_t E = 32, S = 8, K = 2;
    for (const char * spec : { "rule=fetch-all", "policy=quality", "policy=speed", "rule=substitute-all,admit=0.3",
                               "rule=threshold,tau=0.3,admit=0.1,evict=lfu" }) {
        llama_expert_layer_policy p;
        p.init(E, S, cfg_of(std::string(spec) + ",slots=8"));
        std::vector<float> sc(E);
        for (int g = 0; g < 400; ++g) {
            const int n = 1 + (int) (rng() % (S / K));
            std::vector<int32_t> used;
            p.begin_group();
            for (int t = 0; t < n; ++t) {
                for (auto & v : sc) {
                    v = std::uniform_real_distribution<float>(0.0f, 1.0f)(rng);
                }
                std::vector<int32_t> ids;
                while ((int32_t) ids.size() < K) {
                    const int32_t e = (int32_t) (rng() % E);
                    if (std::find(ids.begin(), ids.end(), e) == ids.end()) {
                        ids.push_back(e);
                    }
                }
                auto r = step(p, ids, { 0.7f, 0.3f }, sc);
                for (int32_t i = 0; i < K; ++i) {
                    CHECK(r.act[i] != LLAMA_EXPERT_ACTION_DROP);
                    used.push_back(r.out[i]);
                }
            }
            p.end_group();
            for (int32_t e : used) {
                CHECK(p.is_resident(e));
            }
            CHECK(p.stats.forced_substitutions == 0);
        }
    }
}

int main() {
    test_parse();
    test_admission();
    test_lfu_lru();
    test_rules();
    test_random();
    test_fast_substitute();
    test_group();
    if (n_fail) {
        std::fprintf(stderr, "%d checks failed\n", n_fail);
        return 1;
    }
    std::printf("all expert policy tests passed\n");
    return 0;
}
