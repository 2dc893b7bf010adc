// The cache spec parser as a tool for the Python tests (tests/test_sizes.py, tests/test_spec.py):
//   spec_parse --vram SIZE...   the bytes that vram=SIZE takes, or "error", one line each
//   spec_parse --spec SPEC...   "ok" or "error: <the message>", one line each
//   spec_parse --spec-k K N SPEC...  the same, then the checks for a model with K experts per token of N per layer
//   spec_parse --fuzz N SEED    N random and mutated specs: never a crash, every error one line naming a key or
//                               the accepted keys; prints "fuzz: N specs, K rejected"
#include "llama-expert-policy.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

static bool one_line_naming_a_key(const std::string & err) {
    return !err.empty() && err.find('\n') == std::string::npos &&
        (err.find("key") != std::string::npos || err.find('=') != std::string::npos || err.find("mode") != std::string::npos);
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: spec_parse --vram SIZE... | --spec SPEC... | --spec-k K N SPEC... | --fuzz N SEED\n");
        return 2;
    }
    const std::string mode = argv[1];
    if (mode == "--spec-k" && argc >= 4) {
        const int32_t k = atoi(argv[2]), n_expert = atoi(argv[3]);
        for (int i = 4; i < argc; ++i) {
            llama_expert_cache_config cfg;
            std::string err;
            const bool ok = llama_expert_cache_config_parse(argv[i], cfg, err) && llama_expert_cache_config_check_k(cfg, k, n_expert, err);
            printf(ok ? "ok\n" : "error: %s\n", err.c_str());
        }
        return 0;
    }
    if (mode == "--vram" || mode == "--spec") {
        for (int i = 2; i < argc; ++i) {
            llama_expert_cache_config cfg;
            std::string err;
            const std::string spec = mode == "--vram" ? std::string("mode=emulate,vram=") + argv[i] : argv[i];
            const bool ok = llama_expert_cache_config_parse(spec, cfg, err);
            if (mode == "--vram") {
                if (ok) {
                    printf("%llu\n", (unsigned long long) cfg.vram);
                } else {
                    printf("error\n");
                }
            } else {
                printf(ok ? "ok\n" : "error: %s\n", err.c_str());
            }
        }
        return 0;
    }
    if (mode == "--fuzz" && argc == 4) {
        const int n = atoi(argv[2]);
        std::mt19937 rng((uint32_t) strtoul(argv[3], nullptr, 10));
        const std::vector<std::string> keys = { "mode", "policy", "rule", "tau", "evict", "admit", "halve", "slots",
            "vram", "vram_reserve", "ram", "bypass", "group", "async", "host", "readers", "direct", "tau_file", "ram_slots",
            "profile", "profile_out", "stats", "trace", "trace_top", "j", "m", "alpha", "kmin", "t", "renorm", "light",
            "half_life", "classes", "prefetch", "bogus", "", " ", "==" };
        const std::vector<std::string> vals = { "engine", "emulate", "off", "quality", "speed", "fetch-all", "threshold",
            "drop", "0.15", "-1", "1e9", "25%", "200%", "0", "16", "24G", "24GB", "1.5.3G", "lfu", "lru", "on", "auto",
            "thread", "file", "ram", "cache-route", "zero", "ser", "classlru", "host", "substitute", "0.5", "1.5", "x", "",
            "%", ",", "=", "\xff\xfe", "99999999999999999999999" };
        int rejected = 0;
        for (int i = 0; i < n; ++i) {
            std::string spec;
            const int items = (int) (rng() % 6);
            for (int j = 0; j < items; ++j) {
                if (j) { spec += rng() % 8 ? "," : " , "; }
                spec += keys[rng() % keys.size()];
                if (rng() % 10) { spec += rng() % 5 ? "=" : " = "; spec += vals[rng() % vals.size()]; }
            }
            // byte mutations
            const int muts = (int) (rng() % 3);
            for (int m = 0; m < muts && !spec.empty(); ++m) {
                spec[rng() % spec.size()] = (char) (rng() % 256);
            }
            llama_expert_cache_config cfg;
            std::string err;
            if (!llama_expert_cache_config_parse(spec, cfg, err)) {
                ++rejected;
                if (!one_line_naming_a_key(err)) {
                    printf("fuzz: spec '%s' was rejected with '%s'\n", spec.c_str(), err.c_str());
                    return 1;
                }
            }
        }
        printf("fuzz: %d specs, %d rejected\n", n, rejected);
        return 0;
    }
    fprintf(stderr, "usage: spec_parse --vram SIZE... | --spec SPEC... | --spec-k K N SPEC... | --fuzz N SEED\n");
    return 2;
}
