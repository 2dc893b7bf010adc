// Unit tests of the moe-subst expert residency policy (src/llama/llama-expert-policy.cpp).
// Built and run by tests/test_expert_cache.py: c++ -std=c++17 -O1 -Isrc/llama -Isrc/include this.cpp with the model-free
// sources (MOE_SUBST_POLICY_SOURCES in src/moe-subst.cmake)
#include "llama-expert-budget.h"
#include "llama-expert-policy.h"
#include "llama-expert-profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

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
    std::vector<float>   scale; // factors for the gate weights
};

static step_result step(llama_expert_layer_policy & p, std::vector<int32_t> ids, std::vector<float> w, const std::vector<float> & scores) {
    step_result r;
    r.out.resize(ids.size());
    r.act.resize(ids.size());
    r.scale.resize(ids.size());
    p.decide(ids.data(), w.data(), (int32_t) ids.size(), scores.data(), r.out.data(), r.act.data(), r.scale.data());
    return r;
}

static bool near(double a, double b) {
    return std::fabs(a - b) < 1e-6;
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
    CHECK(!llama_expert_cache_config_parse("policy=fast", cfg, err) && err.find("quality, speed, fetch-all, drop-light") != std::string::npos);
    // policy=drop-light: rule=zero at tau 0.2 (not rule=zero's default 0.03), LFU, no admission; tau may be given
    CHECK(llama_expert_cache_config_parse("policy=drop-light", cfg, err) && cfg.rule == LLAMA_EXPERT_MISS_ZERO &&
          cfg.tau == 0.2f && cfg.evict == LLAMA_EXPERT_EVICT_LFU && !cfg.admit && cfg.preset == "drop-light");
    CHECK(llama_expert_cache_config_parse("policy=drop-light,tau=0.1", cfg, err) && cfg.tau == 0.1f);
    CHECK(llama_expert_cache_config_parse("policy=drop-light,rule=zero", cfg, err) && cfg.tau == 0.03f);
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

// the anchors' keys: values, defaults, and the errors that name the key and the accepted range
static void test_parse_anchors() {
    llama_expert_cache_config cfg;
    std::string err;

    CHECK(llama_expert_cache_config_parse("rule=cache-route", cfg, err) && cfg.rule == LLAMA_EXPERT_MISS_CACHE_ROUTE);
    CHECK(cfg.route_j == 1 && cfg.route_m == 0 && cfg.route_alpha == 1.0f && !cfg.light_host && cfg.preset == "custom");
    CHECK(!llama_expert_cache_config_scales_weights(cfg)); // alpha 1: the weights are left alone
    CHECK(llama_expert_cache_config_parse("rule=cache-route,j=2,m=20,alpha=0.5,light=substitute", cfg, err));
    CHECK(cfg.route_j == 2 && cfg.route_m == 20 && cfg.route_alpha == 0.5f && llama_expert_cache_config_scales_weights(cfg));
    CHECK(llama_expert_cache_config_parse("rule=zero", cfg, err) && cfg.rule == LLAMA_EXPERT_MISS_ZERO);
    CHECK(std::fabs(cfg.tau - 0.03f) < 1e-7f && !cfg.renorm && llama_expert_cache_config_scales_weights(cfg));
    CHECK(llama_expert_cache_config_parse("rule=zero,tau=0.1,renorm=on", cfg, err) && std::fabs(cfg.tau - 0.1f) < 1e-7f && cfg.renorm);
    CHECK(llama_expert_cache_config_parse("rule=ser", cfg, err) && cfg.ser_kmin == 1 && std::fabs(cfg.ser_t - 0.1f) < 1e-7f);
    CHECK(llama_expert_cache_config_parse("rule=ser,kmin=6,t=1,renorm=off", cfg, err) && cfg.ser_kmin == 6 && cfg.ser_t == 1.0f);
    CHECK(llama_expert_cache_config_parse("evict=classlru", cfg, err) && cfg.evict == LLAMA_EXPERT_EVICT_CLASSLRU);
    CHECK(cfg.classlru_half_life == 128 && cfg.classlru_classes == 8);
    CHECK(llama_expert_cache_config_parse("policy=quality,evict=classlru,half_life=64,classes=4", cfg, err));
    CHECK(cfg.classlru_half_life == 64 && cfg.classlru_classes == 4 && cfg.rule == LLAMA_EXPERT_MISS_THRESHOLD);
    CHECK(llama_expert_cache_config_parse("policy=quality,light=host", cfg, err) && cfg.light_host);

    // ranges
    CHECK(!llama_expert_cache_config_parse("rule=cache-route,alpha=1.5", cfg, err) && err.find("'alpha'") != std::string::npos &&
          err.find("[0, 1]") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=cache-route,m=0", cfg, err) && err.find("'m'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=ser,kmin=0", cfg, err) && err.find("'kmin'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=ser,t=-0.1", cfg, err) && err.find("'t'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("evict=classlru,classes=33", cfg, err) && err.find("[1, 32]") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("evict=classlru,half_life=0", cfg, err) && err.find("'half_life'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=zero,renorm=yes", cfg, err) && err.find("'renorm'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("policy=speed,light=cpu", cfg, err) && err.find("'light'") != std::string::npos);
    // keys without effect
    CHECK(!llama_expert_cache_config_parse("policy=quality,alpha=0.5", cfg, err) && err.find("alpha applies to rule=cache-route") == 0);
    CHECK(!llama_expert_cache_config_parse("rule=zero,kmin=2", cfg, err) && err.find("kmin applies to rule=ser") == 0);
    CHECK(!llama_expert_cache_config_parse("policy=speed,renorm=on", cfg, err) && err.find("renorm applies to the rules that drop") == 0);
    CHECK(!llama_expert_cache_config_parse("rule=ser,light=host", cfg, err) && err.find("light applies to the rules that substitute") == 0);
    CHECK(!llama_expert_cache_config_parse("evict=lfu,half_life=10", cfg, err) && err.find("half_life applies to evict=classlru") == 0);
    CHECK(!llama_expert_cache_config_parse("rule=cache-route,light=host,m=20", cfg, err) && err.find("m chooses") == 0);
    CHECK(!llama_expert_cache_config_parse("rule=ser,tau=0.1", cfg, err) && err.find("tau applies to") == 0);
    CHECK(!llama_expert_cache_config_parse("mode=engine,policy=quality,light=host", cfg, err) && err.find("light=host") == 0 &&
          err.find("mode=engine") != std::string::npos);
    // the checks that need k (8 here) and n_expert (64)
    CHECK(llama_expert_cache_config_parse("rule=cache-route,j=8,m=8", cfg, err) && llama_expert_cache_config_check_k(cfg, 8, 64, err));
    CHECK(llama_expert_cache_config_parse("rule=cache-route,j=9", cfg, err) && !llama_expert_cache_config_check_k(cfg, 8, 64, err) &&
          err == "bad value '9' for key 'j' (accepted: a number of ranks in [0, 8], the experts used per token)");
    CHECK(llama_expert_cache_config_parse("rule=cache-route,m=7", cfg, err) && !llama_expert_cache_config_check_k(cfg, 8, 64, err) &&
          err.find("for key 'm' (accepted: a window of router ranks in [8, 64]") != std::string::npos);
    CHECK(llama_expert_cache_config_parse("rule=cache-route,m=65", cfg, err) && !llama_expert_cache_config_check_k(cfg, 8, 64, err));
    CHECK(llama_expert_cache_config_parse("rule=ser,kmin=9", cfg, err) && !llama_expert_cache_config_check_k(cfg, 8, 64, err) &&
          err.find("for key 'kmin' (accepted: a number of ranks in [1, 8]") != std::string::npos);
    CHECK(llama_expert_cache_config_parse("rule=ser,kmin=8", cfg, err) && llama_expert_cache_config_check_k(cfg, 8, 64, err));
}

// colibri's CACHE_ROUTE: ranks < j fetched; later ranks take the best resident of the router's top m, else fetched
static void test_cache_route() {
    // 16 experts, resident 0..7. Router order: 10, 11, 12, 3, 13, 5, 6, 2, then the rest lower
    std::vector<float> scores(16, 0.0f);
    scores[10] = 0.9f; scores[11] = 0.8f; scores[12] = 0.7f; scores[3] = 0.6f;
    scores[13] = 0.55f; scores[5] = 0.5f; scores[6] = 0.45f; scores[2] = 0.4f;
    const std::vector<int32_t> ids = { 10, 11, 12, 3 };
    const std::vector<float>   w   = { 0.5f, 0.2f, 0.1f, 0.2f };
    {
        // m = 6: the window is 10, 11, 12, 3 (selected), 13 (not resident), 5
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=cache-route,j=1,m=6,alpha=0.5,admit=off,evict=lru,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.out[0] == 10);      // rank 0 < j: fetched (evicts 0)
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[1] == 5);  // the best resident in the window
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_FETCH && r.out[2] == 12);      // 5 taken, 6 outside the window: fetch
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_HIT && r.out[3] == 3);
        CHECK(r.scale == (std::vector<float>{ 1.0f, 0.5f, 1.0f, 1.0f }));   // alpha on the substitute only
        CHECK(p.is_resident(10) && p.is_resident(12) && !p.is_resident(0) && !p.is_resident(1)); // LRU, lowest id
        CHECK(p.stats.fetches == 2 && p.stats.substitutions == 1 && p.stats.evictions == 2);
    }
    {
        // m = auto (2k = 8): 6 is in the window too
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=cache-route,admit=off,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[1] == 5);
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[2] == 6);
        CHECK(r.scale == (std::vector<float>{ 1.0f, 1.0f, 1.0f, 1.0f }));
    }
    {
        // j = 0: the first choice too takes a substitute; m = k = 4: no window beyond the selection, all fetched
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=cache-route,j=0,m=6,admit=off,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[0] == 5 && p.stats.subst_first_choice == 1);
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_FETCH && r.act[2] == LLAMA_EXPERT_ACTION_FETCH);
        llama_expert_layer_policy q;
        q.init(16, 8, cfg_of("rule=cache-route,j=0,m=4,admit=off,slots=8"));
        r = step(q, ids, w, scores);
        CHECK(q.stats.fetches == 3 && q.stats.substitutions == 0);
    }
    {
        // light=host: ranks >= j are computed on the host with the missed expert, the residency is unchanged
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=cache-route,j=1,light=host,admit=off,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.out[0] == 10);
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_HOST && r.out[1] == 11 && r.act[2] == LLAMA_EXPERT_ACTION_HOST && r.out[2] == 12);
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_HIT);
        CHECK(r.scale == (std::vector<float>{ 1.0f, 1.0f, 1.0f, 1.0f }));
        CHECK(p.stats.host_computes == 2 && p.stats.fetches == 1 && p.stats.substitutions == 0 && p.stats.misses == 3);
        CHECK(!p.is_resident(11) && !p.is_resident(12) && p.n_resident() == 8 && p.stats.evictions == 1);
    }
}

// colibri's DEGRADE_ZERO: a miss with gate weight below tau is dropped, the others fetched; renorm rescales
static void test_zero() {
    std::vector<float> scores(16, 0.0f);
    const std::vector<int32_t> ids = { 10, 11, 12, 3 }; // 3 resident
    const std::vector<float>   w   = { 0.6f, 0.25f, 0.02f, 0.01f };
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=zero,slots=8")); // tau 0.03
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_DROP && r.out[2] == 12);
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_HIT); // a light hit is computed: only misses are dropped
        CHECK(r.scale == (std::vector<float>{ 1.0f, 1.0f, 0.0f, 1.0f }));
        CHECK(p.stats.drops == 1 && p.stats.fetches == 2 && near(p.stats.drop_mass_sum, 0.02));
        CHECK(!p.is_resident(12) && p.is_resident(10) && p.is_resident(11));
    }
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=zero,tau=0.3,renorm=on,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_DROP && r.act[2] == LLAMA_EXPERT_ACTION_DROP);
        // kept: 0.6 + 0.01 of 0.88: both times 0.88 / 0.61
        const double f = (0.6 + 0.25 + 0.02 + 0.01) / (0.6 + 0.01);
        CHECK(near(r.scale[0], f) && r.scale[1] == 0.0f && r.scale[2] == 0.0f && near(r.scale[3], f));
    }
    {
        // renorm with nothing dropped: factors stay 1
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=zero,tau=0,renorm=on,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.scale == (std::vector<float>{ 1.0f, 1.0f, 1.0f, 1.0f }) && p.stats.drops == 0);
    }
}

// ik_llama.cpp's SER: the first kmin ranks run; a later one only if w > t * w_0; cache-unaware
static void test_ser() {
    std::vector<float> scores(16, 0.0f);
    const std::vector<int32_t> ids = { 10, 3, 12, 4 }; // 3 and 4 resident
    const std::vector<float>   w   = { 0.4f, 0.1f, 0.3f, 0.2f };
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=ser,kmin=2,t=0.5,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH);                   // rank 0: runs, fetched on a miss
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_HIT);                     // rank 1 < kmin: runs although light
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_FETCH);                   // 0.3 > 0.5 * 0.4
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_DROP && r.out[3] == 4);   // 0.2 is not > 0.2: skipped, though resident
        CHECK(r.scale == (std::vector<float>{ 1.0f, 1.0f, 1.0f, 0.0f }));
        CHECK(p.stats.skips == 1 && p.stats.hits == 1 && p.stats.misses == 2 && p.stats.drops == 0 && p.stats.fetches == 2);
        CHECK(p.stats.hits + p.stats.misses + p.stats.skips == p.stats.calls);
        CHECK(p.is_resident(4) && near(p.stats.drop_mass_sum, 0.2));
    }
    {
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=ser,kmin=1,t=0.6,renorm=on,slots=8"));
        auto r = step(p, ids, w, scores);
        // 0.1, 0.2 <= 0.24 skipped; 0.3 > 0.24 runs; the kept 0.7 take the whole 1.0
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_DROP && r.act[2] == LLAMA_EXPERT_ACTION_FETCH && r.act[3] == LLAMA_EXPERT_ACTION_DROP);
        CHECK(near(r.scale[0], 1.0 / 0.7) && r.scale[1] == 0.0f && near(r.scale[2], 1.0 / 0.7) && r.scale[3] == 0.0f);
        CHECK(p.stats.skips == 2);
    }
    {
        // t = 0 or kmin = k: nothing skipped
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=ser,kmin=1,t=0,slots=8"));
        step(p, ids, w, scores);
        llama_expert_layer_policy q;
        q.init(16, 8, cfg_of("rule=ser,kmin=4,t=1,slots=8"));
        step(q, ids, w, scores);
        CHECK(p.stats.skips == 0 && q.stats.skips == 0 && q.stats.fetches == 2);
    }
}

// rule=band (Experiment B): a miss with w in [lo, hi) is substituted at any rank, every other miss is fetched
static void test_band() {
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(llama_expert_cache_config_parse("rule=band", cfg, err) && cfg.rule == LLAMA_EXPERT_MISS_BAND);
    CHECK(cfg.band_lo == 0.0f && cfg.band_hi == 1.0f && cfg.preset == "custom" && !llama_expert_cache_config_scales_weights(cfg));
    CHECK(std::string(llama_expert_miss_rule_name(cfg.rule)) == "band");
    CHECK(llama_expert_cache_config_parse("rule=band,lo=0.3,light=host", cfg, err) && cfg.band_lo == 0.3f && cfg.light_host);
    CHECK(llama_expert_cache_config_parse("rule=band,hi=0.05", cfg, err) && cfg.band_lo == 0.0f && cfg.band_hi == 0.05f);
    CHECK(!llama_expert_cache_config_parse("rule=band,lo=0.2,hi=0.2", cfg, err) && err.find("lo (0.2") != std::string::npos &&
          err.find("must be below hi") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=band,lo=1.5", cfg, err) && err.find("for key 'lo'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("rule=band,hi=-1", cfg, err) && err.find("for key 'hi'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("policy=quality,lo=0.1", cfg, err) && err.find("lo applies to rule=band") == 0);
    CHECK(!llama_expert_cache_config_parse("rule=threshold,hi=0.1", cfg, err) && err.find("hi applies to rule=band") == 0);

    std::vector<float> scores(16, 0.0f);
    scores[5] = 2.0f; scores[6] = 1.0f; // the best resident substitutes: 5, then 6
    const std::vector<int32_t> ids = { 10, 11, 12, 13 }; // all missed (resident: 0..7)
    const std::vector<float>   w   = { 0.5f, 0.3f, 0.15f, 0.05f };
    {
        // heavy band [0.3, 1]: rank 0 (0.5) and rank 1 (0.3, the band's closed end) substituted, the light ones fetched
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=band,lo=0.3,evict=lru,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[0] == 5);
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[1] == 6);
        CHECK(r.act[2] == LLAMA_EXPERT_ACTION_FETCH && r.act[3] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(p.stats.substitutions == 2 && p.stats.subst_first_choice == 1 && p.stats.fetches == 2);
        CHECK(near(p.stats.subst_mass_sum, 0.8) && p.is_resident(12) && p.is_resident(13) && !p.is_resident(10));
    }
    {
        // light band [0, 0.15): only the 0.05 miss substituted (0.15 is the open end), rank 0 fetched
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=band,hi=0.15,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_FETCH && r.act[2] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[3] == 5);
        CHECK(p.stats.substitutions == 1 && p.stats.subst_first_choice == 0 && near(p.stats.subst_mass_sum, 0.05));
    }
    {
        // hi = 1 has no upper bound: a gate weight of exactly 1 is in the band
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=band,lo=0.9,slots=8"));
        auto r = step(p, { 10 }, { 1.0f }, scores);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE);
    }
}

// rule=budget (issue 37): per token, the lightest misses substituted while their summed gate weight stays within
// mass; the first that would exceed it and every heavier miss fetched; hits spend nothing
static void test_rule_budget() {
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(llama_expert_cache_config_parse("rule=budget", cfg, err) && cfg.rule == LLAMA_EXPERT_MISS_BUDGET);
    CHECK(cfg.budget_mass == 0.1f && std::string(llama_expert_miss_rule_name(cfg.rule)) == "budget");
    CHECK(llama_expert_cache_config_parse("rule=budget,mass=0.25", cfg, err) && cfg.budget_mass == 0.25f);
    CHECK(!llama_expert_cache_config_parse("rule=budget,mass=1.5", cfg, err) && err.find("for key 'mass'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("policy=quality,mass=0.1", cfg, err) && err.find("mass applies to rule=budget") == 0);

    std::vector<float> scores(16, 0.0f);
    scores[5] = 2.0f; scores[6] = 1.0f; scores[4] = 0.5f; // the best resident substitutes: 5, 6, then 4
    const std::vector<int32_t> ids = { 10, 11, 12, 13, 3 }; // 10..13 missed, 3 a hit (resident: 0..7)
    const std::vector<float>   w   = { 0.4f, 0.25f, 0.15f, 0.1f, 0.1f };
    {
        // mass 0.3: 0.1 (rank 3) and 0.15 (rank 2) fit (0.25), 0.25 would exceed: ranks 0 and 1 fetched; the hit spends nothing
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=budget,mass=0.3,evict=lru,slots=8"));
        auto r = step(p, ids, w, scores);
        CHECK(r.act[3] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.act[2] == LLAMA_EXPERT_ACTION_SUBSTITUTE);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_FETCH && r.act[4] == LLAMA_EXPERT_ACTION_HIT);
        CHECK(p.stats.substitutions == 2 && p.stats.fetches == 2 && near(p.stats.subst_mass_sum, 0.25));
    }
    {
        // mass 0: a budget of nothing fetches every miss (fetch-all); mass 1: every miss substituted, rank 0 included
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=budget,mass=0,slots=8"));
        step(p, ids, w, scores);
        CHECK(p.stats.substitutions == 0 && p.stats.fetches == 4);
        llama_expert_layer_policy q;
        q.init(16, 8, cfg_of("rule=budget,mass=1,slots=8"));
        step(q, ids, w, scores);
        CHECK(q.stats.substitutions == 4 && q.stats.fetches == 0 && q.stats.subst_first_choice == 1);
    }
    {
        // the budget is per token: a second token has its own
        llama_expert_layer_policy p;
        p.init(16, 8, cfg_of("rule=budget,mass=0.12,evict=lru,admit=off,slots=8"));
        step(p, { 10, 11 }, { 0.9f, 0.1f }, scores);
        step(p, { 12, 13 }, { 0.9f, 0.1f }, scores);
        CHECK(p.stats.substitutions == 2 && p.stats.fetches == 2 && near(p.stats.subst_mass_sum, 0.2));
    }
}

// rule=band with min_rank=1 (the row's own key, added through the rule and key tables only): a miss at a rank below
// min_rank is fetched whatever its weight, the band applies from min_rank on, so that Experiment B can tell a band of
// weights apart from the first choice
static void test_band_min_rank() {
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(llama_expert_cache_config_parse("rule=band,lo=0.3,min_rank=1", cfg, err) && cfg.band_min_rank == 1);
    CHECK(llama_expert_cache_config_parse("rule=band", cfg, err) && cfg.band_min_rank == 0);
    CHECK(!llama_expert_cache_config_parse("rule=threshold,min_rank=1", cfg, err) &&
          err == "min_rank applies to rule=band, not to rule=threshold: remove min_rank, or use rule=band");
    CHECK(!llama_expert_cache_config_parse("rule=band,min_rank=x", cfg, err) && err.find("for key 'min_rank'") != std::string::npos);
    CHECK(llama_expert_cache_config_parse("rule=band,min_rank=5", cfg, err) && !llama_expert_cache_config_check_k(cfg, 4, 16, err) &&
          err.find("bad value '5' for key 'min_rank' (accepted: a rank in [0, 4]") == 0);
    CHECK(llama_expert_cache_config_parse("rule=band,min_rank=4", cfg, err) && llama_expert_cache_config_check_k(cfg, 4, 16, err));

    // the verdict alone: pure, from the table's row
    const llama_expert_rule & row = llama_expert_rule_of(LLAMA_EXPERT_MISS_BAND);
    CHECK(std::string(row.name) == "band" && llama_expert_rule_owns(row, "min_rank") && !llama_expert_rule_owns(row, "tau"));
    CHECK(llama_expert_cache_config_parse("rule=band,lo=0.3,min_rank=1", cfg, err));
    const llama_expert_params par = llama_expert_cache_config_params(cfg);
    CHECK(llama_expert_rule_verdict(row, 0, 0.5f, false, par) == LLAMA_EXPERT_VERDICT_FETCH);
    CHECK(llama_expert_rule_verdict(row, 1, 0.5f, false, par) == LLAMA_EXPERT_VERDICT_SUBSTITUTE);
    CHECK(llama_expert_rule_verdict(row, 1, 0.2f, false, par) == LLAMA_EXPERT_VERDICT_FETCH);
    CHECK(llama_expert_rule_describe(row, par, 4, 16) ==
          "band: misses with gate weight in [0.300, 1]) substituted at ranks >= 1, the others fetched");

    // the same misses as test_band's heavy band: rank 0 (0.5) is now fetched, rank 1 (0.3) still substituted
    std::vector<float> scores(16, 0.0f);
    scores[5] = 2.0f; scores[6] = 1.0f;
    const std::vector<int32_t> ids = { 10, 11, 12, 13 };
    const std::vector<float>   w   = { 0.5f, 0.3f, 0.15f, 0.05f };
    llama_expert_layer_policy p;
    p.init(16, 8, cfg_of("rule=band,lo=0.3,min_rank=1,evict=lru,slots=8"));
    auto r = step(p, ids, w, scores);
    CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.out[0] == 10);
    CHECK(r.act[1] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[1] == 5);
    CHECK(r.act[2] == LLAMA_EXPERT_ACTION_FETCH && r.act[3] == LLAMA_EXPERT_ACTION_FETCH);
    CHECK(p.stats.substitutions == 1 && p.stats.subst_first_choice == 0 && p.stats.fetches == 3);
}

// rule=band with max_rank=M (issue 22): a miss at a rank above max_rank is fetched whatever its weight, so that the
// study's light first choices (`rule=band,hi=H,max_rank=0`) substitute nothing but first choices; with min_rank, the
// band substitutes at the ranks in [min_rank, max_rank]
static void test_band_max_rank() {
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(llama_expert_cache_config_parse("rule=band", cfg, err) && cfg.band_max_rank == -1);
    CHECK(llama_expert_cache_config_parse("rule=band,hi=0.15,max_rank=0", cfg, err) && cfg.band_max_rank == 0);
    CHECK(llama_expert_cache_config_parse("rule=band,min_rank=1,max_rank=1", cfg, err) && cfg.band_min_rank == 1 &&
          cfg.band_max_rank == 1);
    CHECK(!llama_expert_cache_config_parse("rule=band,min_rank=2,max_rank=1", cfg, err) &&
          err == "rule=band substitutes at the ranks in [min_rank, max_rank]: min_rank (2) must not be above max_rank (1)");
    CHECK(!llama_expert_cache_config_parse("rule=threshold,max_rank=0", cfg, err) &&
          err == "max_rank applies to rule=band, not to rule=threshold: remove max_rank, or use rule=band");
    CHECK(!llama_expert_cache_config_parse("rule=band,max_rank=-1", cfg, err) && err.find("for key 'max_rank'") != std::string::npos);
    CHECK(llama_expert_cache_config_parse("rule=band,max_rank=3", cfg, err) && llama_expert_cache_config_check_k(cfg, 4, 16, err));
    CHECK(llama_expert_cache_config_parse("rule=band,max_rank=4", cfg, err) && !llama_expert_cache_config_check_k(cfg, 4, 16, err) &&
          err.find("bad value '4' for key 'max_rank' (accepted: a rank in [0, 3], below the experts used per token (4)") == 0);
    CHECK(llama_expert_cache_config_parse("rule=fetch-all", cfg, err) && llama_expert_cache_config_check_k(cfg, 4, 16, err));

    // the verdicts at ranks 0, 1 and k-1 (k = 4), in the band (w = 0.1) and outside it (w = 0.5)
    const llama_expert_rule & row = llama_expert_rule_of(LLAMA_EXPERT_MISS_BAND);
    CHECK(llama_expert_rule_owns(row, "max_rank") && llama_expert_rule_owns(row, "min_rank"));
    const auto verdict = [&](const char * spec, int32_t rank, float w) {
        return llama_expert_rule_verdict(row, rank, w, false, llama_expert_cache_config_params(cfg_of(spec)));
    };
    const llama_expert_verdict S = LLAMA_EXPERT_VERDICT_SUBSTITUTE, F = LLAMA_EXPERT_VERDICT_FETCH;
    // max_rank=0: the first choice only
    CHECK(verdict("rule=band,hi=0.15,max_rank=0", 0, 0.1f) == S);
    CHECK(verdict("rule=band,hi=0.15,max_rank=0", 1, 0.1f) == F);
    CHECK(verdict("rule=band,hi=0.15,max_rank=0", 3, 0.1f) == F);
    CHECK(verdict("rule=band,hi=0.15,max_rank=0", 0, 0.5f) == F);
    // max_rank=1: ranks 0 and 1
    CHECK(verdict("rule=band,hi=0.15,max_rank=1", 0, 0.1f) == S);
    CHECK(verdict("rule=band,hi=0.15,max_rank=1", 1, 0.1f) == S);
    CHECK(verdict("rule=band,hi=0.15,max_rank=1", 3, 0.1f) == F);
    CHECK(verdict("rule=band,hi=0.15,max_rank=1", 1, 0.5f) == F);
    // min_rank=1,max_rank=1: rank 1 only; no max_rank: every rank from min_rank
    CHECK(verdict("rule=band,hi=0.15,min_rank=1,max_rank=1", 0, 0.1f) == F);
    CHECK(verdict("rule=band,hi=0.15,min_rank=1,max_rank=1", 1, 0.1f) == S);
    CHECK(verdict("rule=band,hi=0.15,min_rank=1,max_rank=1", 3, 0.1f) == F);
    CHECK(verdict("rule=band,hi=0.15", 3, 0.1f) == S);
    // every first-choice miss, whatever its weight
    CHECK(verdict("rule=band,lo=0,hi=1,max_rank=0", 0, 1.0f) == S && verdict("rule=band,lo=0,hi=1,max_rank=0", 0, 0.0f) == S);
    CHECK(verdict("rule=band,lo=0,hi=1,max_rank=0", 1, 0.5f) == F);

    // the start-up log's line and the statistics' config block (no max_rank: the last rank, k - 1)
    CHECK(llama_expert_rule_describe(row, llama_expert_cache_config_params(cfg_of("rule=band,hi=0.15,max_rank=0")), 4, 16) ==
          "band: misses with gate weight in [0.000, 0.150000) substituted at rank 0 only, the others fetched");
    CHECK(llama_expert_rule_describe(row, llama_expert_cache_config_params(cfg_of("rule=band,max_rank=2")), 4, 16) ==
          "band: misses with gate weight in [0.000, 1]) substituted at ranks <= 2, the others fetched");
    CHECK(llama_expert_rule_describe(row, llama_expert_cache_config_params(cfg_of("rule=band,lo=0.15,min_rank=1,max_rank=2")), 4, 16) ==
          "band: misses with gate weight in [0.150, 1]) substituted at ranks 1 to 2, the others fetched");
    CHECK(llama_expert_cache_config_json(cfg_of("rule=band,max_rank=0"), 16, 4, 8, "").find("\"band_max_rank\": 0,\n") != std::string::npos);
    CHECK(llama_expert_cache_config_json(cfg_of("rule=band,min_rank=1"), 16, 4, 8, "").find(
          "\"band_min_rank\": 1,\n\"band_max_rank\": 3,\n") != std::string::npos);

    // a token whose four misses all lie in the band [0, 0.4), max_rank=0: rank 0 substituted, ranks 1 to 3 fetched
    std::vector<float> scores(16, 0.0f);
    scores[5] = 2.0f; scores[6] = 1.0f;
    const std::vector<int32_t> ids = { 10, 11, 12, 13 };
    const std::vector<float>   w   = { 0.3f, 0.3f, 0.15f, 0.05f };
    llama_expert_layer_policy p;
    p.init(16, 8, cfg_of("rule=band,hi=0.4,max_rank=0,evict=lru,slots=8"));
    auto r = step(p, ids, w, scores);
    CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[0] == 5);
    CHECK(r.act[1] == LLAMA_EXPERT_ACTION_FETCH && r.act[2] == LLAMA_EXPERT_ACTION_FETCH && r.act[3] == LLAMA_EXPERT_ACTION_FETCH);
    CHECK(p.stats.substitutions == 1 && p.stats.subst_first_choice == 1 && p.stats.fetches == 3);
}

// the rule table: a row per enum value, in enum order, names unique; the spec's rule list is the table's
static void test_rule_table() {
    CHECK(LLAMA_EXPERT_N_RULES == LLAMA_EXPERT_MISS_BUDGET + 1);
    for (int32_t i = 0; i < LLAMA_EXPERT_N_RULES; ++i) {
        const llama_expert_rule & r = LLAMA_EXPERT_RULES[i];
        CHECK(r.id == (llama_expert_miss_rule) i && r.miss != nullptr);
        CHECK(&llama_expert_rule_of(r.id) == &r && llama_expert_rule_find(r.name) == &r);
        llama_expert_cache_config cfg;
        std::string err;
        CHECK(llama_expert_cache_config_parse(std::string("rule=") + r.name, cfg, err) && cfg.rule == r.id);
        CHECK(llama_expert_cache_config_scales_weights(cfg) == r.drops);
        for (int32_t j = 0; j < i; ++j) {
            CHECK(std::string(LLAMA_EXPERT_RULES[j].name) != r.name);
        }
    }
    CHECK(llama_expert_rule_find("bands") == nullptr);
}

// the residency and budget arithmetic (llama-expert-budget.h): numbers in, numbers out, no model
static void test_budget() {
    // a percentage of the layer's experts: rounded to the nearest (halves away from zero), at least 1, at most all
    CHECK(llama_expert_slots_for_residency(64, 25.0) == 16);
    CHECK(llama_expert_slots_for_residency(10, 25.0) == 3);  // 2.5 -> 3
    CHECK(llama_expert_slots_for_residency(6, 25.0) == 2);   // 1.5 -> 2
    CHECK(llama_expert_slots_for_residency(128, 12.5) == 16);
    CHECK(llama_expert_slots_for_residency(64, 0.1) == 1);
    CHECK(llama_expert_slots_for_residency(64, 100.0) == 64);
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(llama_expert_cache_config_parse("slots=25%", cfg, err) && llama_expert_cache_config_n_slots(cfg, 10) == 3);

    const uint64_t MiB = 1ull << 20;
    llama_expert_budget b;
    b.budget   = 1024*MiB;
    b.weights  = 500*MiB;
    b.context  = 100*MiB;
    b.reserve  = 256*MiB;
    b.per_slot = 2*MiB;
    b.n_banks  = 6;
    b.n_expert = 64;
    b.k        = 8;
    // fixed: weights + context + reserve + the spare slot + 512 bytes per bank; (budget - fixed) / per_slot slots
    CHECK(b.fixed() == 858*MiB + 3072 && b.minimum() == 874*MiB + 3072);
    err.clear();
    CHECK(llama_expert_budget_slots(b, err) == 64 && err.empty()); // 82 fit, at most n_expert
    CHECK(llama_expert_budget_plan_line(b, 64) == "expert cache plan: vram=1073741824 weights=524288000 context=104857600 "
          "reserve=268435456 readers=0 baseline=0 per_slot=2097152 banks=6 n_expert=64 k=8 slots=64");
    b.n_expert = 128;
    CHECK(llama_expert_budget_slots(b, err) == 82); // (1024 - 858 MiB - 3 KiB) / 2 MiB = 82.99
    b.budget = b.minimum() - 1;
    CHECK(llama_expert_budget_slots(b, err) == -1 && err.find("vram=874 MiB is too small") == 0 &&
          err.find("need at least 875 MiB") != std::string::npos);
    b.ram = true;
    b.budget = b.minimum();
    CHECK(llama_expert_budget_slots(b, err) == 8 && llama_expert_budget_plan_line(b, 8).find("expert cache plan: ram=") == 0);
    b.per_slot = 0;
    CHECK(llama_expert_budget_slots(b, err) == -1);
}

// light=host with a threshold rule: the light miss is computed on the host, and counts toward admission
static void test_light_host() {
    std::vector<float> scores(16, 0.0f);
    const std::vector<int32_t> ids = { 10, 11, 12, 3 };
    const std::vector<float>   w   = { 0.5f, 0.2f, 0.1f, 0.2f };
    llama_expert_layer_policy p;
    p.init(16, 8, cfg_of("rule=threshold,tau=0.15,light=host,admit=0.15,slots=8"));
    auto r = step(p, ids, w, scores);
    CHECK(r.act[0] == LLAMA_EXPERT_ACTION_FETCH && r.act[1] == LLAMA_EXPERT_ACTION_FETCH);
    CHECK(r.act[2] == LLAMA_EXPERT_ACTION_HOST && r.out[2] == 12 && r.act[3] == LLAMA_EXPERT_ACTION_HIT);
    CHECK(p.stats.host_computes == 1 && p.stats.substitutions == 0 && !p.is_resident(12) && p.stats.admissions == 0);
    CHECK(p.stats.fetches + p.stats.substitutions + p.stats.drops + p.stats.host_computes == p.stats.misses);
    r = step(p, ids, w, scores); // 0.1 + 0.1 >= 0.15: 12 admitted at the end of the token
    CHECK(r.act[2] == LLAMA_EXPERT_ACTION_HOST && p.is_resident(12) && p.stats.admissions == 1);
    r = step(p, ids, w, scores);
    CHECK(r.act[2] == LLAMA_EXPERT_ACTION_HIT);
}

// upstream llama.cpp's ClassLRU: decayed counts (kept after eviction), classes floor(log2(count)), victim the
// largest age / 2^class among the least recently used of each class
static void test_classlru() {
    const std::vector<float> scores(8, 0.0f);
    {
        // resident 0, 1, 2, 3; half-life long enough that counts stay just below their integers
        // A = 0: 9 uses (class 3), the oldest; C = 1: 3 uses (class 1); D = 3: 5 uses (class 2); B = 2: 1 use (class 0)
        llama_expert_layer_policy p;
        p.init(8, 4, cfg_of("rule=fetch-all,evict=classlru,half_life=1000000,slots=4"));
        for (int e : { 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 3, 3, 3, 3, 3, 2 }) {
            CHECK(step(p, { e }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_HIT);
        }
        CHECK(p.classlru_class(0) == 3 && p.classlru_class(1) == 1 && p.classlru_class(3) == 2 && p.classlru_class(2) == 0);
        // token 19: ages 10, 7, 1, 2 -> 10/8 = 1.25, 7/2 = 3.5, 1/1 = 1, 2/4 = 0.5: C is the victim
        // (LRU would evict A, LFU B)
        CHECK(step(p, { 4 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(!p.is_resident(1) && p.is_resident(0) && p.is_resident(2) && p.is_resident(3) && p.is_resident(4));
        // ghost history: C's count survives its eviction (about 3 + 1, not 1)
        CHECK(step(p, { 1 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH);
        CHECK(p.classlru_count(1) > 3.99 && p.classlru_count(1) < 4.0 && p.classlru_class(1) == 1);
        // token 20 evicted: ages 11 (A, class 3: 1.375), 2 (B, class 0: 2), 3 (D, class 2: 0.75), 1 (4, class 0: 1) -> B
        CHECK(!p.is_resident(2) && p.is_resident(4) && p.stats.evictions == 2);
        // reset clears the history
        p.reset();
        CHECK(p.classlru_count(1) == 0.0 && p.is_resident(1));
    }
    {
        // exact decay: one use at tick 1, half-life 2: 2^(-4/2) at tick 5
        llama_expert_layer_policy p;
        p.init(8, 4, cfg_of("rule=fetch-all,evict=classlru,half_life=2,slots=4"));
        step(p, { 0 }, { 1.0f }, scores);
        for (int t = 0; t < 4; ++t) {
            step(p, { 1 }, { 1.0f }, scores);
        }
        CHECK(std::fabs(p.classlru_count(0) - 0.25) < 1e-12);
        CHECK(std::fabs(p.classlru_count(1) - (1.0 + std::sqrt(0.5) + 0.5 + std::sqrt(0.125))) < 1e-12 && p.classlru_class(1) == 1);
    }
    {
        // classes clamp: 9 uses is class 3, with classes=2 class 1
        llama_expert_layer_policy p;
        p.init(8, 4, cfg_of("rule=fetch-all,evict=classlru,half_life=1000000,classes=2,slots=4"));
        for (int t = 0; t < 9; ++t) {
            step(p, { 0 }, { 1.0f }, scores);
        }
        CHECK(p.classlru_class(0) == 1);
    }
}

// random sequences: counters are consistent and the rules' invariants hold
static void test_random() {
    std::mt19937 rng(42);
    const char * specs[] = {
        "policy=quality,slots=16", "policy=speed,slots=16", "policy=fetch-all,slots=16",
        "rule=substitute-all,admit=off,slots=16", "rule=drop,slots=16", "rule=threshold,evict=lru,admit=0.3,slots=16",
        "rule=cache-route,slots=16", "rule=cache-route,j=2,m=12,alpha=0.7,admit=0.3,evict=classlru,slots=16",
        "rule=zero,tau=0.08,renorm=on,slots=16", "rule=ser,kmin=3,t=0.3,evict=classlru,half_life=32,slots=16",
        "policy=quality,light=host,slots=16", "policy=fetch-all,evict=classlru,slots=16",
        "rule=band,lo=0.2,admit=0.5,evict=lfu,slots=16", "rule=band,hi=0.05,evict=lru,slots=16",
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
            // the router's rank of every expert (ties cannot occur with continuous logits)
            std::vector<int32_t> rank(E);
            {
                std::vector<int32_t> all(E);
                for (int e = 0; e < E; ++e) all[e] = e;
                std::sort(all.begin(), all.end(), [&](int a, int b) { return logits[a] > logits[b]; });
                for (int i = 0; i < E; ++i) rank[all[i]] = i;
            }
            const int32_t m = cfg.route_m > 0 ? cfg.route_m : 2 * k;
            float kept = 0.0f;
            for (int r = 0; r < k; ++r) {
                kept += res.act[r] == LLAMA_EXPERT_ACTION_DROP ? 0.0f : w[r];
            }
            for (int r = 0; r < k; ++r) {
                if (cfg.rule == LLAMA_EXPERT_MISS_CACHE_ROUTE) {
                    CHECK(r >= cfg.route_j || res.act[r] == LLAMA_EXPERT_ACTION_HIT || res.act[r] == LLAMA_EXPERT_ACTION_FETCH);
                    if (res.act[r] == LLAMA_EXPERT_ACTION_SUBSTITUTE) {
                        CHECK(rank[res.out[r]] < m && res.scale[r] == cfg.route_alpha);
                    }
                }
                if (res.act[r] == LLAMA_EXPERT_ACTION_DROP) {
                    CHECK(res.scale[r] == 0.0f);
                    if (cfg.rule == LLAMA_EXPERT_MISS_ZERO) CHECK(w[r] < cfg.tau);
                    if (cfg.rule == LLAMA_EXPERT_MISS_SER) CHECK(r >= cfg.ser_kmin && !(w[r] > cfg.ser_t * w[0]));
                } else if (cfg.renorm && kept < 1.0f - 1e-6f) {
                    CHECK(std::fabs(res.scale[r] - 1.0f / kept) < 1e-4f); // the weights sum to 1
                }
                if (cfg.rule == LLAMA_EXPERT_MISS_ZERO && w[r] >= cfg.tau) CHECK(res.act[r] != LLAMA_EXPERT_ACTION_DROP);
                if (cfg.rule == LLAMA_EXPERT_MISS_SER && r >= cfg.ser_kmin && !(w[r] > cfg.ser_t * w[0])) {
                    CHECK(res.act[r] == LLAMA_EXPERT_ACTION_DROP);
                }
                if (res.act[r] == LLAMA_EXPERT_ACTION_HOST) {
                    CHECK(cfg.light_host && res.out[r] == ids[r] && r > 0 && w[r] < cfg.tau); // (it may be admitted at the end)
                }
                if (cfg.rule == LLAMA_EXPERT_MISS_BAND && res.act[r] == LLAMA_EXPERT_ACTION_SUBSTITUTE) {
                    CHECK(w[r] >= cfg.band_lo && (w[r] < cfg.band_hi || cfg.band_hi >= 1.0f));
                }
                if (cfg.rule == LLAMA_EXPERT_MISS_BAND && res.act[r] == LLAMA_EXPERT_ACTION_FETCH) {
                    CHECK(!(w[r] >= cfg.band_lo && (w[r] < cfg.band_hi || cfg.band_hi >= 1.0f)));
                }
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
        CHECK(s.hits + s.misses + s.skips == s.calls);
        CHECK(s.fetches + s.substitutions + s.drops + s.host_computes == s.misses);
        CHECK((s.skips > 0) == (cfg.rule == LLAMA_EXPERT_MISS_SER));
        CHECK((s.host_computes > 0) == cfg.light_host);
        CHECK(s.calls == 3000u * k && s.token_layers == 3000u);
        uint64_t hist = 0;
        for (auto c : s.mass_hist) hist += c;
        CHECK(hist == s.token_layers);
        CHECK(s.forced_substitutions == 0);
        if (cfg.rule == LLAMA_EXPERT_MISS_CACHE_ROUTE) {
            CHECK(s.substitutions > 0 && s.fetches > 0);
        }
        if (cfg.rule == LLAMA_EXPERT_MISS_ZERO || cfg.rule == LLAMA_EXPERT_MISS_SER) {
            CHECK(s.substitutions == 0 && s.fetches > 0);
        }
        if (cfg.rule == LLAMA_EXPERT_MISS_ZERO) {
            CHECK(s.drops > 0);
        }
        if (cfg.rule == LLAMA_EXPERT_MISS_THRESHOLD) {
            CHECK(subst_fc == 0 && s.subst_first_choice == 0);
            if (cfg.tau == 0.15f) {
                CHECK(subst_heavy == 0 && s.max_subst_weight < 0.15f);
            }
            CHECK(s.substitutions > 0 || cfg.light_host);
        }
        if (cfg.light_host) {
            CHECK(s.substitutions == 0 && s.host_computes > 0);
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
        if (cfg.admit && cfg.rule != LLAMA_EXPERT_MISS_FETCH_ALL && cfg.rule != LLAMA_EXPERT_MISS_ZERO &&
                cfg.rule != LLAMA_EXPERT_MISS_SER) {
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
        CHECK(fast.experts() == slow.experts());
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

// three tiers: the RAM tier (LRU, inclusive of what is loaded through it) and the threshold per source tier
static void test_ram_tier() {
    const std::vector<float> scores(8, 0.0f);
    {
        llama_expert_layer_policy p;
        p.init(8, 2, cfg_of("mode=emulate,host=file,rule=fetch-all,evict=lru,slots=2,ram_slots=3"));
        CHECK(p.n_ram == 3 && p.ram_expert_of(0) == 0 && p.ram_expert_of(1) == 1 && p.ram_expert_of(2) == -1);
        step(p, { 2 }, { 1.0f }, scores); // from the file, into the free RAM slot; slot of 0 (LRU, lowest id)
        CHECK(p.stats.file_loads == 1 && p.stats.ram_tier_loads == 0 && p.in_ram(2) && !p.is_resident(0));
        step(p, { 0 }, { 1.0f }, scores); // the RAM tier holds 0
        CHECK(p.stats.file_loads == 1 && p.stats.ram_tier_loads == 1 && p.is_resident(0) && !p.is_resident(1));
        step(p, { 3 }, { 1.0f }, scores); // from the file; the RAM tier evicts 1 (untouched since the start)
        CHECK(p.stats.file_loads == 2 && p.in_ram(3) && !p.in_ram(1) && p.in_ram(0) && p.in_ram(2));
        step(p, { 1 }, { 1.0f }, scores); // 1 is read from the file again; the RAM tier evicts 2 (LRU: tick 1)
        CHECK(p.stats.file_loads == 3 && p.in_ram(1) && !p.in_ram(2) && p.stats.fetches == 4);
        // two tiers (no ram_slots): nothing counted
        llama_expert_layer_policy q;
        q.init(8, 2, cfg_of("mode=emulate,host=file,rule=fetch-all,slots=2"));
        step(q, { 5 }, { 1.0f }, scores);
        CHECK(q.n_ram == 0 && q.stats.file_loads == 0 && q.stats.ram_tier_loads == 0 && q.stats.fetches == 1);
    }
    {
        // k = 2; rank 1 weighs 0.4: a miss the RAM tier holds is fetched (tau = 0.1), one from the file is
        // substituted (tau_file = 0.9)
        llama_expert_layer_policy p;
        p.init(8, 4, cfg_of("mode=emulate,host=file,rule=threshold,tau=0.1,tau_file=0.9,slots=4,ram_slots=6"));
        // resident 0..3, RAM 0..3; bring 4 into RAM and slots, then push it out of the slots (not of RAM)
        step(p, { 4, 0 }, { 0.6f, 0.4f }, scores);
        CHECK(p.is_resident(4) && p.in_ram(4) && p.stats.file_loads == 1);
        step(p, { 0, 1 }, { 0.6f, 0.4f }, scores); // 1 (evicted above) is in RAM: fetched from it
        CHECK(p.stats.ram_tier_loads == 1 && p.is_resident(1));
        step(p, { 5, 0 }, { 0.6f, 0.4f }, scores); // rank 0 from the file (first choices are fetched)
        step(p, { 6, 1 }, { 0.6f, 0.4f }, scores);
        CHECK(!p.is_resident(4) && p.in_ram(4));
        auto r = step(p, { 0, 4 }, { 0.6f, 0.4f }, scores); // 4 in RAM: 0.4 >= tau -> fetched
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_FETCH && p.stats.ram_tier_loads == 2);
        r = step(p, { 0, 7 }, { 0.6f, 0.4f }, scores); // 7 only in the file: 0.4 < tau_file -> substituted
        CHECK(r.act[1] == LLAMA_EXPERT_ACTION_SUBSTITUTE && !p.in_ram(7));
    }
}

// prefetch=on: predicted experts admitted before the token they were predicted for; used-before-eviction and
// wasted accounting
static void test_prefetch() {
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(llama_expert_cache_config_parse("policy=quality,prefetch=on", cfg, err) && cfg.prefetch);
    CHECK(llama_expert_cache_config_parse("policy=quality,prefetch=off", cfg, err) && !cfg.prefetch);
    CHECK(llama_expert_cache_config_parse("policy=quality", cfg, err) && !cfg.prefetch);
    CHECK(!llama_expert_cache_config_parse("prefetch=yes", cfg, err) && err.find("'prefetch'") != std::string::npos &&
          err.find("on") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("prefetch=on,prefetch=off", cfg, err) && err.find("'prefetch'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("mode=engine,async=off,prefetch=on", cfg, err) &&
          err.find("prefetch=on") != std::string::npos && err.find("async=off") != std::string::npos);
    CHECK(llama_expert_cache_config_parse("mode=engine,async=thread,prefetch=on", cfg, err) && cfg.prefetch);
    CHECK(llama_expert_cache_config_parse("mode=off,prefetch=on", cfg, err) && cfg.off_ignored == "prefetch");

    const std::vector<float> scores(6, 0.0f);
    {
        // LRU, k = 1, resident 0, 1, 2
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lru,slots=3,prefetch=on"));
        CHECK(p.params().prefetch);
        for (int e : { 0, 1, 2 }) {
            step(p, { e }, { 1.0f }, scores);
        }
        const int32_t a[1] = { 4 };
        CHECK(p.prefetch_experts(a, 1) == 1); // evicts 0, the least recently used
        CHECK(p.is_resident(4) && !p.is_resident(0) && p.stats.prefetches == 1 && p.stats.evictions == 1);
        CHECK(p.stats.calls == 3 && p.stats.token_layers == 3); // a prefetch is no decision
        CHECK(step(p, { 4 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_HIT);
        CHECK(p.stats.prefetch_used == 1 && p.stats.fetches == 0);
        step(p, { 4 }, { 1.0f }, scores); // a second use counts once
        CHECK(p.stats.prefetch_used == 1);
        const int32_t b[2] = { 5, 4 };
        CHECK(p.prefetch_experts(b, 2) == 1); // 4 is resident; 5 evicts 1 (4, predicted too, is kept)
        CHECK(p.is_resident(5) && p.is_resident(4) && !p.is_resident(1) && p.stats.prefetches == 2);
        step(p, { 2 }, { 1.0f }, scores);
        step(p, { 4 }, { 1.0f }, scores);
        CHECK(step(p, { 3 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH); // evicts 5, never used
        CHECK(!p.is_resident(5) && p.stats.prefetch_wasted == 1 && p.stats.prefetch_used == 1);
        CHECK(p.stats.prefetches == 2 && p.stats.evictions == 3 && p.stats.fetches == 1);
        p.reset();
        CHECK(p.stats.prefetches == 0 && p.is_resident(0) && !p.is_resident(4));
    }
    {
        // a prediction never evicts its own experts: 2 slots, 3 predicted: 2 admitted
        llama_expert_layer_policy p;
        p.init(6, 2, cfg_of("rule=fetch-all,evict=lfu,slots=2"));
        const int32_t a[3] = { 3, 4, 5 };
        CHECK(p.prefetch_experts(a, 3) == 2);
        CHECK(p.is_resident(3) && p.is_resident(4) && !p.is_resident(5) && p.stats.prefetches == 2);
        // -1 entries (no prediction) are skipped
        const int32_t none[2] = { -1, -1 };
        CHECK(p.prefetch_experts(none, 2) == 0 && p.stats.prefetches == 2);
        // the experts of the previous token are not protected (the prefetch comes between two tokens)
        step(p, { 3 }, { 1.0f }, scores);
        const int32_t c[1] = { 0 };
        CHECK(p.prefetch_experts(c, 1) == 1 && p.is_resident(0) && p.is_resident(3) && !p.is_resident(4));
        CHECK(p.stats.prefetch_wasted == 1 && p.stats.prefetch_used == 1); // 4 evicted unused, 3 used
    }
    {
        // in a group, the experts its tokens computed with are held
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lru,slots=3"));
        p.begin_group();
        step(p, { 0 }, { 1.0f }, scores);
        const int32_t a[3] = { 3, 4, 5 };
        CHECK(p.prefetch_experts(a, 3) == 2 && p.is_resident(0) && p.is_resident(3) && p.is_resident(4));
        step(p, { 5 }, { 1.0f }, scores); // fetched: evicts 3 (LRU among the unheld, ties lowest id)
        p.end_group();
        CHECK(p.is_resident(0) && p.is_resident(5) && p.stats.prefetch_wasted == 1);
    }
    {
        // a prefetched expert used as a substitute counts as used
        llama_expert_layer_policy p;
        p.init(6, 2, cfg_of("rule=substitute-all,admit=off,evict=lru,slots=2"));
        std::vector<float> sc = { 0.1f, 0.2f, 0, 0, 0, 0.9f };
        const int32_t a[1] = { 5 };
        CHECK(p.prefetch_experts(a, 1) == 1 && p.is_resident(5));
        auto r = step(p, { 3 }, { 1.0f }, sc);
        CHECK(r.act[0] == LLAMA_EXPERT_ACTION_SUBSTITUTE && r.out[0] == 5 && p.stats.prefetch_used == 1);
    }
    {
        // the prefill bypass's warm-up evicting a prefetched expert unused counts it wasted
        llama_expert_layer_policy p;
        p.init(6, 2, cfg_of("rule=fetch-all,evict=lru,slots=2"));
        const int32_t a[1] = { 5 };
        p.prefetch_experts(a, 1);
        llama_expert_policy_warm(p, { 4, 3, 0, 0, 0, 0 });
        CHECK(p.is_resident(0) && p.is_resident(1) && !p.is_resident(5) && p.stats.prefetch_wasted == 1);
    }
    // prefetch_max=N: the first N non-resident experts of the prediction, in rank order
    CHECK(llama_expert_cache_config_parse("policy=quality,prefetch=on,prefetch_max=2", cfg, err) && cfg.prefetch_max == 2);
    CHECK(llama_expert_cache_config_parse("policy=quality,prefetch=on,prefetch_max=all", cfg, err) && cfg.prefetch_max == 0);
    CHECK(!llama_expert_cache_config_parse("policy=quality,prefetch=on,prefetch_max=0", cfg, err) &&
          err.find("'prefetch_max'") != std::string::npos);
    CHECK(!llama_expert_cache_config_parse("policy=quality,prefetch_max=2", cfg, err) &&
          err.find("prefetch_max= limits") != std::string::npos && err.find("needs prefetch=on") != std::string::npos);
    {
        llama_expert_layer_policy p;
        p.init(8, 4, cfg_of("rule=fetch-all,evict=lru,slots=4,prefetch=on,prefetch_max=2"));
        const int32_t a[4] = { 0, 5, 6, 7 }; // 0 is resident: 5 and 6 admitted, 7 over the budget
        CHECK(p.prefetch_experts(a, 4) == 2);
        CHECK(p.is_resident(5) && p.is_resident(6) && !p.is_resident(7) && p.stats.prefetches == 2);
    }
    {
        // drop_prefetched: a prefetched expert not computed with leaves its slot empty (neither used nor wasted);
        // one computed with, one not prefetched and one not resident are refused
        llama_expert_layer_policy p;
        p.init(6, 3, cfg_of("rule=fetch-all,evict=lru,slots=3,prefetch=on"));
        const int32_t a[2] = { 4, 5 };
        CHECK(p.prefetch_experts(a, 2) == 2 && p.is_resident(4) && p.is_resident(5));
        const int32_t slot5 = p.slot_of(5);
        CHECK(step(p, { 4 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_HIT && p.stats.prefetch_used == 1);
        CHECK(!p.drop_prefetched(4) && p.is_resident(4)); // computed with
        CHECK(!p.drop_prefetched(1) && !p.drop_prefetched(3)); // not prefetched; not resident
        CHECK(p.drop_prefetched(5) && !p.is_resident(5) && p.expert_of(slot5) == -1);
        CHECK(p.stats.prefetch_dropped == 1 && p.stats.prefetch_wasted == 0 && p.stats.prefetches == 2);
        CHECK(!p.drop_prefetched(5));
        // the empty slot is taken first, with no eviction
        const uint64_t ev = p.stats.evictions;
        CHECK(step(p, { 3 }, { 1.0f }, scores).act[0] == LLAMA_EXPERT_ACTION_FETCH && p.expert_of(slot5) == 3);
        CHECK(p.stats.evictions == ev);
    }
    {
        // three tiers: a dropped prefetch leaves the RAM tier too
        llama_expert_layer_policy p;
        p.init(6, 2, cfg_of("mode=emulate,host=file,rule=fetch-all,evict=lru,slots=2,ram_slots=3,prefetch=on"));
        const int32_t a[1] = { 5 };
        CHECK(p.prefetch_experts(a, 1) == 1 && p.ram_slot_of(5) >= 0);
        const int32_t s2 = p.ram_slot_of(5);
        CHECK(p.drop_prefetched(5) && p.ram_slot_of(5) == -1 && p.ram_expert_of(s2) == -1);
    }
}

// the four path keys refuse a FIFO, a device or a folder when the spec is parsed (opening a FIFO blocks); a path
// that does not exist yet, a regular file and a standard stream are fine
static void test_parse_special_files() {
    char dir[] = "/tmp/moe-subst-paths-XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(false && "mkdtemp");
        return;
    }
    const std::string fifo = std::string(dir) + "/pipe";
    const std::string file = std::string(dir) + "/file";
    CHECK(mkfifo(fifo.c_str(), 0600) == 0);
    if (FILE * f = std::fopen(file.c_str(), "w")) {
        std::fclose(f);
    }
    for (const char * key : { "profile", "profile_out", "stats", "trace" }) {
        llama_expert_cache_config cfg;
        std::string err;
        const std::string k = key;
        CHECK(!llama_expert_cache_config_parse("policy=quality," + k + "=" + fifo, cfg, err));
        CHECK(err == k + "=" + fifo + " is a FIFO (named pipe), not a regular file: pass a file (opening it would "
                     "block, or read and write without end)");
        CHECK(!llama_expert_cache_config_parse(k + "=/dev/zero", cfg, err) && err.find("a character device") != std::string::npos);
        CHECK(!llama_expert_cache_config_parse(k + "=" + dir, cfg, err) && err == k + "=" + dir + " is a folder, not a file");
        CHECK(llama_expert_cache_config_parse(k + "=" + file, cfg, err));
        CHECK(llama_expert_cache_config_parse(k + "=" + std::string(dir) + "/new", cfg, err));
        CHECK(llama_expert_cache_config_parse(k + "=/dev/stdout", cfg, err));
    }
    unlink(fifo.c_str());
    unlink(file.c_str());
    rmdir(dir);
}

int main() {
    test_parse();
    test_parse_special_files();
    test_ram_tier();
    test_parse_anchors();
    test_cache_route();
    test_zero();
    test_ser();
    test_band();
    test_rule_budget();
    test_band_min_rank();
    test_band_max_rank();
    test_rule_table();
    test_budget();
    test_light_host();
    test_classlru();
    test_admission();
    test_lfu_lru();
    test_rules();
    test_random();
    test_fast_substitute();
    test_group();
    test_prefetch();
    if (n_fail) {
        std::fprintf(stderr, "%d checks failed\n", n_fail);
        return 1;
    }
    std::printf("all expert policy tests passed\n");
    return 0;
}
