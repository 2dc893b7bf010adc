// Host cost of the expert cache's route step (moe-subst, issue 3): the real route op of libllama (patched),
// called directly on synthetic router outputs, one token per call (decode) or a batch per call.
//
// Built and run by scripts/bench_expert_cache.py:
//   c++ -O2 -std=c++17 -I<tree>/include -I<tree>/ggml/include -I<tree>/src bench_route_step.cpp \
//       -L<bin> -lllama -lggml -lggml-base -Wl,-rpath,<bin> -o bench_route_step
//   bench_route_step MODEL.gguf SPEC N_TOKENS BATCH
//
// MODEL gives n_expert, k and the layers (any MoE GGUF). Router logits: per-expert popularity plus noise,
// top-k by logit, softmax gating with normalised weights (as qwen3moe). In the engine the route step reads
// logits that the router has just written (in cache): the benchmark reads each row just before the call, as
// the router would have written it, and subtracts the time of that read alone (a second loop). The reported
// time is the minimum over 10 rounds of the mean time per token-layer, which discounts preemption on a busy
// host.

#include "llama.h"
#include "llama-expert-cache-impl.h"
#include "llama-model.h"

#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

struct custom_op_params { // the layout of ggml's struct ggml_custom_op_params (ggml-impl.h)
    ggml_custom_op_t fun;
    int              n_tasks;
    void *           userdata;
};

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL SPEC N_TOKENS BATCH\n", argv[0]);
        return 2;
    }
    const int n_tokens = atoi(argv[3]);
    const int batch    = atoi(argv[4]);

    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    auto mparams = llama_model_default_params();
    mparams.vocab_only = false;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }

    llama_expert_cache_config cfg;
    std::string err;
    if (!llama_expert_cache_config_parse(argv[2], cfg, err)) {
        fprintf(stderr, "bad spec: %s\n", err.c_str());
        return 1;
    }
    llama_expert_cache_impl cache(cfg, *model);
    const int E = cache.n_expert;
    const int k = cache.n_used;
    int il = 0;
    while (!cache.layers[il]->moe) {
        ++il;
    }

    // router outputs for all tokens, made up front
    std::mt19937 rng(1);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> pop(E);
    for (auto & p : pop) {
        p = 1.5f * nd(rng);
    }
    const int n_rows = std::max(batch, 256);
    std::vector<float>   logits((size_t) n_rows * E);
    std::vector<int32_t> ids((size_t) n_rows * k);
    std::vector<int32_t> order(E);
    for (int t = 0; t < n_rows; ++t) {
        float * lg = logits.data() + (size_t) t * E;
        for (int e = 0; e < E; ++e) {
            lg[e] = pop[e] + nd(rng);
            order[e] = e;
        }
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [lg](int a, int b) { return lg[a] > lg[b]; });
        std::copy(order.begin(), order.begin() + k, ids.begin() + (size_t) t * k);
    }

    ggml_init_params ip = { 64 * ggml_tensor_overhead() + 1024 * 1024, nullptr, true };
    ggml_context * ctx = ggml_init(ip);
    ggml_tensor * t_ids    = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, k, batch);
    ggml_tensor * t_logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, E, batch);
    ggml_tensor * scale = nullptr;
    ggml_tensor * route = cache.build_route(ctx, t_ids, t_logits, nullptr, LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX,
            true, false, il, &scale);
    if (route == t_ids) {
        fprintf(stderr, "no route step (slots < k?)\n");
        return 1;
    }
    std::vector<int32_t> out((size_t) k * batch);
    route->data = out.data();
    custom_op_params p;
    memcpy(&p, route->op_params, sizeof(p));

    const int rounds = 10;
    volatile float sink = 0.0f;
    const auto warm = [&](int row) {
        float acc = 0.0f;
        const float * lg = logits.data() + (size_t) row * E;
        for (int i = 0; i < batch * E; i += 16) {
            acc += lg[i];
        }
        sink = sink + acc;
    };
    double best = 1e30, best_warm = 1e30;
    const int n_calls = n_tokens / batch;
    for (int round = 0; round < rounds; ++round) {
        cache.reset();
        auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < n_calls; ++c) {
            const int row = (c * batch) % (n_rows / batch * batch);
            warm(row);
            t_ids->data    = ids.data() + (size_t) row * k;
            t_logits->data = logits.data() + (size_t) row * E;
            p.fun(route, 0, 1, p.userdata);
        }
        double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, ns / (n_calls * batch));
        t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < n_calls; ++c) {
            warm((c * batch) % (n_rows / batch * batch));
        }
        ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
        best_warm = std::min(best_warm, ns / (n_calls * batch));
    }
    best -= best_warm;
    const auto & s = cache.layers[il]->policy.stats;
    printf("{\"n_expert\": %d, \"k\": %d, \"slots\": %d, \"batch\": %d, \"spec\": \"%s\", \"ns_per_token_layer\": %.1f, "
           "\"miss_rate\": %.4f, \"substitution_rate\": %.4f}\n",
           E, k, cache.n_slots, batch, argv[2], best, (double) s.misses / s.calls, (double) s.substitutions / s.calls);

    ggml_free(ctx);
    llama_model_free(model);
    return 0;
}
