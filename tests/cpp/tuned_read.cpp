// The tuned-profile reader (src/llama/llama-expert-tuned.cpp) as a tool for tests/test_tuned.py, which runs the Python
// reference (harness.domain.tune.auto_policy) on the same cases and compares:
//   tuned_read --policy PATH FILE_NAME FILE_BYTES FINGERPRINT PLANNED_SLOTS   "<policy>\t<why>" (PATH "-": none found)
//   tuned_read --locations MODEL FINGERPRINT MOE_SUBST_CACHE XDG_CACHE_HOME HOME  one path a line ("-": unset)
//   tuned_read --find MODEL FINGERPRINT                                       the path found, or "-"
//   tuned_read --policy-keys                                                  LLAMA_EXPERT_TUNED_POLICY_KEYS, one a line
#include "llama-expert-tuned.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

static const char * arg_or_null(const char * a) {
    return std::strcmp(a, "-") == 0 ? nullptr : a;
}

int main(int argc, char ** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "--policy" && argc == 7) {
        llama_expert_tuned_model mine;
        mine.file_name   = argv[3];
        mine.file_bytes  = std::strtoull(argv[4], nullptr, 10);
        mine.fingerprint = argv[5];
        std::string policy;
        std::string why;
        const std::string path = std::strcmp(argv[2], "-") == 0 ? "" : argv[2];
        llama_expert_tuned_policy(path, mine, std::atoi(argv[6]), policy, why);
        std::printf("%s\t%s\n", policy.c_str(), why.c_str());
        return 0;
    }
    if (mode == "--locations" && argc == 7) {
        for (const std::string & p : llama_expert_tuned_locations(argv[2], argv[3], arg_or_null(argv[4]),
                arg_or_null(argv[5]), arg_or_null(argv[6]))) {
            std::printf("%s\n", p.c_str());
        }
        return 0;
    }
    if (mode == "--find" && argc == 4) {
        const std::string p = llama_expert_tuned_find(argv[2], argv[3]);
        std::printf("%s\n", p.empty() ? "-" : p.c_str());
        return 0;
    }
    if (mode == "--policy-keys" && argc == 2) {
        for (const char * k : LLAMA_EXPERT_TUNED_POLICY_KEYS) {
            std::printf("%s\n", k);
        }
        return 0;
    }
    std::fprintf(stderr, "usage: tuned_read --policy PATH FILE_NAME FILE_BYTES FINGERPRINT SLOTS | --locations MODEL "
        "FINGERPRINT CACHE XDG HOME | --find MODEL FINGERPRINT | --policy-keys\n");
    return 2;
}
