// Does a warmup decode (llama_set_warmup: every expert selected) read the experts through the mapping?
// Prints the resident set size (bytes) before and after one warmup decode of two tokens.
// Built by tests/test_engine.py against the patched libllama; the cache comes from LLAMA_MOE_CACHE.
#include "llama.h"

#include <cstdio>
#include <unistd.h>

static long long rss_bytes() {
    long long size = 0, resident = 0;
    FILE * f = std::fopen("/proc/self/statm", "r");
    if (f == nullptr || std::fscanf(f, "%lld %lld", &size, &resident) != 2) {
        return -1;
    }
    std::fclose(f);
    return resident * sysconf(_SC_PAGESIZE);
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: warmup_reads MODEL.gguf\n");
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx     = 64;
    cp.n_batch   = 64;
    cp.n_ubatch  = 64;
    cp.n_threads = cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        std::fprintf(stderr, "cannot create the context\n");
        return 1;
    }
    const long long before = rss_bytes();
    llama_set_warmup(ctx, true);
    llama_token tokens[2] = { 1, 2 };
    const int rc = llama_decode(ctx, llama_batch_get_one(tokens, 2));
    llama_synchronize(ctx);
    const long long after = rss_bytes();
    llama_set_warmup(ctx, false);
    std::printf("%d %lld %lld\n", rc, before, after);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
