// Prints the bytes that the cache spec's size keys take for each argument (vram=ARG), or "error": the C++ side of
// tests/test_sizes.py's check that the spec and the harness parse sizes alike.
#include "llama-expert-policy.h"

#include <cstdio>
#include <string>

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; ++i) {
        llama_expert_cache_config cfg;
        std::string err;
        if (llama_expert_cache_config_parse((std::string("mode=emulate,vram=") + argv[i]).c_str(), cfg, err)) {
            printf("%llu\n", (unsigned long long) cfg.vram);
        } else {
            printf("error\n");
        }
    }
    return 0;
}
