#include "llama-expert-cache.h"

#include "llama-adapter.h"
#include "llama-context.h"
#include "llama-graph.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <unistd.h>

//
// construction
//

static std::unique_ptr<llama_expert_cache> expert_cache_create(const llama_model & model, const llama_memory_i * memory,
        const char * spec);

std::unique_ptr<llama_expert_cache> llama_expert_cache::from_env(const llama_model & model, const llama_memory_i * memory) {
    const char * spec = getenv(LLAMA_EXPERT_CACHE_ENV);
    if (spec == nullptr || spec[0] == '\0') {
        return nullptr;
    }
    if (model.hparams.no_alloc) {
        // a memory-fitting dry run (llama.cpp's -fit probe, followed by the real context): it plans with the cache's
        // memory when the cache can be made; otherwise without it, silently, so that an error is reported once, by
        // the real context, whose outcome alone counts (the probe loads without mmap and may count the weights
        // differently: it must not refuse a budget that the real context accepts, nor the reverse)
        try {
            return expert_cache_create(model, memory, spec);
        } catch (const std::exception & e) {
            LLAMA_LOG_DEBUG("%s: the memory-fitting probe plans without the expert cache: %s\n", __func__, e.what());
            return nullptr;
        }
    }
    return expert_cache_create(model, memory, spec);
}

static std::unique_ptr<llama_expert_cache> expert_cache_create(const llama_model & model, const llama_memory_i * memory,
        const char * spec) {
    llama_expert_cache_config cfg;
    std::string err;
    if (!llama_expert_cache_config_parse(spec, cfg, err)) {
        throw std::runtime_error(std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + spec + "': " + err);
    }
    if (cfg.mode == LLAMA_EXPERT_CACHE_MODE_OFF) {
        if (!cfg.off_ignored.empty() && !model.hparams.no_alloc) {
            LLAMA_LOG_WARN("%s: %s='%s': mode=off: the cache is off and %s have no effect\n", __func__,
                LLAMA_EXPERT_CACHE_ENV, spec, cfg.off_ignored.c_str());
        }
        return nullptr;
    }
    std::map<ggml_backend_buffer_type_t, size_t> ctx_mem;
    if (memory) {
        ctx_mem = memory->memory_breakdown();
    }
    return std::make_unique<llama_expert_cache>(cfg, model, ctx_mem);
}

llama_expert_cache::llama_expert_cache(const llama_expert_cache_config & cfg_, const llama_model & model,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem) : cfg(cfg_), model(&model) {
    const auto & hparams = model.hparams;
    const std::string prefix = std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + cfg.spec + "': ";

    // a memory-fitting dry run (llama.cpp's -fit probe) sizes the cache but never runs: it writes, prints and
    // traces nothing, so that no all-zero statistics file is left looking like the run's
    dry_run = hparams.no_alloc;
    test_gating = getenv("LLAMA_MOE_CACHE_TEST_GATING") != nullptr;
    if (!dry_run) {
        // the output paths are checked now, not after a long run
        for (const std::string * path : { &cfg.stats, &cfg.profile_out }) {
            if (path->empty()) {
                continue;
            }
            const bool existed = access(path->c_str(), F_OK) == 0;
            FILE * f = fopen(path->c_str(), "a");
            if (f == nullptr) {
                throw std::runtime_error(prefix + (path == &cfg.stats ? "stats=" : "profile_out=") + *path +
                    ": cannot write there (" + strerror(errno) + ")");
            }
            fclose(f);
            if (!existed) {
                remove(path->c_str());
            }
        }
    }

    n_layer  = (int32_t) std::max<size_t>(hparams.n_layer(), model.layers.size()); // including MTP/nextn layers
    n_expert = (int32_t) hparams.n_expert;
    n_used   = (int32_t) hparams.n_expert_used_max();

    if (n_expert <= 0 || n_used <= 0) {
        throw std::runtime_error(prefix + "mode=" + llama_expert_cache_mode_name(cfg.mode) +
            " needs a Mixture-of-Experts model, and this model (" + llm_arch_name(model.arch) + ") has no routed experts");
    }
    if (model.arch == LLM_ARCH_GROVEMOE) {
        throw std::runtime_error(prefix + "grovemoe routes two expert sets per layer (ffn_*_exps and ffn_*_chexps), which "
            "the expert cache cannot serve: run it without the cache (unset LLAMA_MOE_CACHE, or mode=off)");
    }

    arch = llm_arch_name(model.arch);

    n_slots = llama_expert_cache_config_n_slots(cfg, n_expert);
    if (cfg.vram > 0 || cfg.ram > 0) {
        std::vector<bool> moe(n_layer);
        for (int32_t il = 0; il < n_layer; ++il) {
            moe[il] = il < (int32_t) model.layers.size() &&
                (model.layers[il].ffn_down_exps != nullptr || model.layers[il].ffn_gate_up_exps != nullptr);
        }
        n_slots = llama_expert_engine_slots_for_budget(model, moe, n_expert, n_used, cfg.ram > 0 ? cfg.ram : cfg.vram,
            cfg.vram_reserve, ctx_mem, prefix, cfg.ram > 0);
    }
    if (n_slots > n_expert) {
        throw std::runtime_error(prefix + "slots=" + std::to_string(n_slots) + " is more than the " +
            std::to_string(n_expert) + " experts per layer");
    }
    if (n_slots < n_used) {
        throw std::runtime_error(prefix + "slots=" + std::to_string(n_slots) + " is fewer than the " +
            std::to_string(n_used) + " experts used per token; give at least " + std::to_string(n_used));
    }
    {
        std::string err;
        if (!llama_expert_cache_config_check_k(cfg, n_used, n_expert, err)) {
            throw std::runtime_error(prefix + err);
        }
    }

    // small multi-token ubatches computed from the banks together: their experts (at most group*k) must fit
    group_max = cfg.group < 0 ? n_slots / n_used : std::min(cfg.group, n_slots / n_used);
    if (cfg.bypass > 0) {
        group_max = std::min<int32_t>(group_max, (int32_t) cfg.bypass - 1);
    }
    group_max = std::max<int32_t>(group_max, 1);

    std::vector<std::vector<uint64_t>> profile;
    if (!cfg.profile.empty()) {
        std::string err;
        if (!llama_expert_profile_read(cfg.profile, profile, err)) {
            throw std::runtime_error(prefix + err);
        }
    }

    int32_t n_moe = 0;
    layers.resize(n_layer);
    for (int32_t il = 0; il < n_layer; ++il) {
        auto L = std::make_unique<llama_expert_cache_layer>();
        L->cache = this;
        L->il    = il;
        L->moe   = il < (int32_t) model.layers.size() &&
            (model.layers[il].ffn_down_exps != nullptr || model.layers[il].ffn_gate_up_exps != nullptr);
        L->policy.init(n_expert, n_slots, cfg);
        if (L->moe && !profile.empty()) {
            if (il >= (int32_t) profile.size() || (int32_t) profile[il].size() != n_expert) {
                throw std::runtime_error(prefix + "profile '" + cfg.profile + "' has no counts for layer " +
                    std::to_string(il) + " with " + std::to_string(n_expert) + " experts");
            }
            L->policy.set_initial(&profile[il]);
        }
        n_moe += L->moe;
        layers[il] = std::move(L);
    }
    // prefetch: each MoE layer predicts the next MoE layer with that layer's router
    for (int32_t il = 0, prev = -1; il < n_layer; ++il) {
        if (layers[il]->moe) {
            if (prev >= 0 && il < (int32_t) model.layers.size() && model.layers[il].ffn_gate_inp != nullptr) {
                layers[prev]->next_moe = il;
            }
            prev = il;
        }
    }

    if (cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE) {
        std::vector<bool> moe(n_layer);
        for (int32_t il = 0; il < n_layer; ++il) {
            moe[il] = layers[il]->moe;
        }
        engine = std::make_unique<llama_expert_engine>(model, moe, n_expert, n_slots, cfg.async, prefix.c_str(), cfg.host_file,
                                                       cfg.readers, cfg.direct,
                                                       llama_expert_cache_config_n_ram_slots(cfg, n_expert));
        // initial fill: the policy's initial residency
        for (int32_t il = 0; il < n_layer; ++il) {
            if (layers[il]->moe) {
                engine->sync(il, layers[il]->policy);
                engine->layers[il].stats_init = engine->layers[il].stats;
            }
        }
        if (engine->failed()) {
            throw std::runtime_error(engine->failure());
        }
        engine->reset_stats();
    }

    trace_top = std::min<uint32_t>(cfg.trace_top, (uint32_t) n_expert);
    if (!cfg.trace.empty() && !dry_run) {
        trace_open();
    }

    LLAMA_LOG_INFO("%s: mode = %s, policy = %s (rule = %s, tau = %.3f, evict = %s, admit = %s, beta = %.3f, lfu halving every %u tokens)\n",
        __func__, llama_expert_cache_mode_name(cfg.mode), cfg.preset.c_str(), llama_expert_miss_rule_name(cfg.rule),
        cfg.tau, llama_expert_evict_name(cfg.evict), cfg.admit ? "on" : "off", cfg.beta, cfg.lfu_halve);
    switch (cfg.rule) {
        case LLAMA_EXPERT_MISS_CACHE_ROUTE:
            LLAMA_LOG_INFO("%s: cache-route: ranks < %d always computed, substitutes from the router's top %d, alpha = %.3f, light misses %s\n",
                __func__, cfg.route_j, cfg.route_m > 0 ? cfg.route_m : std::min(n_expert, 2*n_used), cfg.route_alpha,
                cfg.light_host ? "on the host" : "substituted");
            break;
        case LLAMA_EXPERT_MISS_SER:
            LLAMA_LOG_INFO("%s: ser: kmin = %d, t = %.3f, renorm = %s\n", __func__, cfg.ser_kmin, cfg.ser_t, cfg.renorm ? "on" : "off");
            break;
        case LLAMA_EXPERT_MISS_BAND:
            LLAMA_LOG_INFO("%s: band: misses with gate weight in [%.3f, %s) substituted at any rank, the others fetched%s\n",
                __func__, cfg.band_lo, cfg.band_hi >= 1.0f ? "1]" : std::to_string(cfg.band_hi).c_str(),
                cfg.light_host ? " (light=host: computed on the host)" : "");
            break;
        case LLAMA_EXPERT_MISS_ZERO:
        case LLAMA_EXPERT_MISS_DROP:
            LLAMA_LOG_INFO("%s: renorm = %s\n", __func__, cfg.renorm ? "on" : "off");
            break;
        default:
            if (cfg.light_host) {
                LLAMA_LOG_INFO("%s: light misses computed on the host\n", __func__);
            }
            break;
    }
    if (cfg.prefetch) {
        LLAMA_LOG_INFO("%s: prefetch: each MoE layer's route step predicts the next MoE layer's experts with that layer's router%s\n",
            __func__, engine ? "; one-token ubatches copy them in the background" : "");
    }
    if (cfg.evict == LLAMA_EXPERT_EVICT_CLASSLRU) {
        LLAMA_LOG_INFO("%s: classlru: half-life %u tokens, %u classes\n", __func__, cfg.classlru_half_life, cfg.classlru_classes);
    }
    LLAMA_LOG_INFO("%s: %d of %d experts resident per layer (%.1f%%), %d used per token, %d MoE layers%s%s\n",
        __func__, n_slots, n_expert, 100.0 * n_slots / n_expert, n_used, n_moe,
        cfg.profile.empty() ? "" : ", initial residency from ", cfg.profile.c_str());
    if (group_max > 1) {
        LLAMA_LOG_INFO("%s: ubatches of 2 to %d tokens are decided as a group (their experts held resident together)%s\n",
            __func__, group_max, engine ? " and computed from the cache banks" : "");
    }
}

// A statistics, profile or trace file that could not be written at the end of a run (the cache is destroyed with the
// context, after the tool's last word): one line on stderr (the tool's log may be silenced or already drained, as in
// llama-bench), and the process exits with status 1 instead of 0. The exit handler is registered when libllama is
// loaded, before any tool registers its own (common's log drain), so that it runs last, after them.
static std::atomic<bool> g_expert_cache_write_failed{false};

static void expert_cache_exit_handler() {
    if (g_expert_cache_write_failed.load()) {
        fflush(nullptr);
        _exit(EXIT_FAILURE);
    }
}

__attribute__((constructor)) static void expert_cache_register_exit_handler() {
    atexit(expert_cache_exit_handler);
}

static void expert_cache_write_failed(const std::string & spec, const char * key, const std::string & path, int err,
        const char * what) {
    fprintf(stderr, "%s='%s': %s=%s: %s could not be written at the end of the run (%s); the process will exit with "
        "status 1: free space or give another path\n", LLAMA_EXPERT_CACHE_ENV, spec.c_str(), key, path.c_str(), what,
        err ? strerror(err) : "write error");
    fflush(stderr);
    g_expert_cache_write_failed = true;
}

llama_expert_cache::~llama_expert_cache() {
    if (dry_run) {
        return;
    }
    print_stats();
    if (!cfg.stats.empty()) {
        errno = 0;
        if (write_stats(cfg.stats)) {
            LLAMA_LOG_INFO("%s: statistics written to %s\n", __func__, cfg.stats.c_str());
        } else {
            expert_cache_write_failed(cfg.spec, "stats", cfg.stats, errno, "the statistics");
        }
    }
    if (!cfg.profile_out.empty()) {
        std::vector<const llama_expert_layer_policy *> ps;
        std::vector<int32_t> ids;
        for (const auto & L : layers) {
            if (L->moe) {
                ps.push_back(&L->policy);
                ids.push_back(L->il);
            }
        }
        errno = 0;
        if (!llama_expert_profile_write(cfg.profile_out, ps, ids)) {
            expert_cache_write_failed(cfg.spec, "profile_out", cfg.profile_out, errno, "the profile");
        }
    }
    if (trace) {
        errno = 0;
        const bool ok = !ferror(trace);
        if (fclose(trace) != 0 || !ok) {
            expert_cache_write_failed(cfg.spec, "trace", cfg.trace, errno, "the router trace");
        }
        trace = nullptr;
    }
}

void llama_expert_cache::reset() {
    if (engine) {
        // no copy in flight or deferred past this point
        for (auto & L : layers) {
            if (L->moe) {
                engine->complete(L->il, L->policy);
            }
        }
    }
    for (auto & L : layers) {
        L->policy.reset();
        L->route_ns      = 0;
        L->route_tokens  = 0;
        L->gating_checked   = 0;
        L->gating_ratio_min = 1e300;
        L->gating_ratio_max = -1e300;
        L->bypass_tokens = 0;
        L->pred_tokens   = -1;
    }
    if (engine) {
        // back to the initial residency in the banks too; these copies do not count
        for (auto & L : layers) {
            if (L->moe) {
                engine->sync(L->il, L->policy);
            }
        }
        engine->reset_stats();
    }
    if (trace) {
        fclose(trace);
        trace = nullptr;
        trace_open();
    }
}

//
// router trace, see docs/expert-cache.md
//

// header: 64 bytes, little-endian
//   char     magic[8]  = "MOETRACE"
//   uint32   version, header_size (64), n_layer, n_expert, k, top_m, record_size, n_slots
//   uint32   reserved[6] = 0
// record (record_size bytes), one per token and MoE layer, in the order decided:
//   uint32   layer, token (index within the layer since the start, or the last reset)
//   int32    ids[k]        selected experts, rank order
//   float32  weights[k]    normalised gate weights
//   int32    used[k]       expert computed with (= ids[r] unless substituted)
//   uint8    action[k]     0 hit, 1 fetch, 2 substitute, 3 drop; padded with zeros to a multiple of 4
//   int32    top_ids[top_m]    the top_m experts by router score, descending
//   float32  top_score[top_m]  their router scores (probability, plus the selection bias if the model has one)
//   int32    pred[k]       version 2: the experts the previous MoE layer predicted for this token-layer (its
//                          input through this layer's router, top k), -1 where there was no prediction

void llama_expert_cache::trace_open() {
    trace = fopen(cfg.trace.c_str(), "wb");
    if (!trace) {
        throw std::runtime_error(std::string(LLAMA_EXPERT_CACHE_ENV) + ": cannot open the trace file '" + cfg.trace + "'");
    }
    const uint32_t k = (uint32_t) n_used;
    trace_rsize = 8 + 12*k + ((k + 3) & ~3u) + 8*trace_top + 4*k;
    uint32_t hdr[14] = {
        LLAMA_EXPERT_TRACE_VERSION, 64, (uint32_t) n_layer, (uint32_t) n_expert, k, trace_top, trace_rsize,
        (uint32_t) n_slots, 0, 0, 0, 0, 0, 0,
    };
    fwrite("MOETRACE", 1, 8, trace);
    fwrite(hdr, sizeof(hdr), 1, trace);
}

void llama_expert_cache::trace_write(const llama_expert_cache_layer & L, uint32_t token, const int32_t * ids, const float * w,
                                     const int32_t * out, const uint8_t * act, const float * scores, const int32_t * pred) {
    const int32_t k = n_used;
    uint32_t head[2] = { (uint32_t) L.il, token };
    fwrite(head, sizeof(head), 1, trace);
    fwrite(ids, sizeof(int32_t), k, trace);
    fwrite(w,   sizeof(float),   k, trace);
    fwrite(out, sizeof(int32_t), k, trace);
    uint8_t a[4*((LLAMA_MAX_EXPERTS + 3)/4)] = {};
    memcpy(a, act, k);
    fwrite(a, 1, (k + 3) & ~3, trace);

    if (trace_top > 0) {
        auto & top = const_cast<llama_expert_cache_layer &>(L).top;
        top.resize(n_expert);
        for (int32_t e = 0; e < n_expert; ++e) {
            top[e] = e;
        }
        std::partial_sort(top.begin(), top.begin() + trace_top, top.end(), [scores](int32_t a, int32_t b) {
            return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
        });
        fwrite(top.data(), sizeof(int32_t), trace_top, trace);
        for (uint32_t i = 0; i < trace_top; ++i) {
            const float s = scores[top[i]];
            fwrite(&s, sizeof(float), 1, trace);
        }
    }
    if (pred) {
        fwrite(pred, sizeof(int32_t), k, trace);
    } else {
        const int32_t none = -1;
        for (int32_t r = 0; r < k; ++r) {
            fwrite(&none, sizeof(int32_t), 1, trace);
        }
    }
}

//
// the route step
//

// The route step, in three parts: gating (the gate weights and the router's ranking, recomputed on the host),
// policy (llama_expert_layer_policy::decide, token by token), engine (copies and slot ids; mode=engine only).

// router probabilities of all E experts from their logits, for the gating function
static void route_probs(llama_expert_gating_func_type gating, const float * lg, int32_t E, float * p) {
    switch (gating) {
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX:
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT:
            {
                float m = -INFINITY;
                for (int32_t e = 0; e < E; ++e) { m = std::max(m, lg[e]); }
                double sum = 0.0;
                for (int32_t e = 0; e < E; ++e) { p[e] = expf(lg[e] - m); sum += p[e]; }
                const float inv = (float) (1.0 / sum);
                for (int32_t e = 0; e < E; ++e) { p[e] *= inv; }
            } break;
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID:
            for (int32_t e = 0; e < E; ++e) { p[e] = 1.0f / (1.0f + expf(-lg[e])); }
            break;
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS:
            for (int32_t e = 0; e < E; ++e) { p[e] = sqrtf(lg[e] > 20.0f ? lg[e] : log1pf(expf(lg[e]))); }
            break;
        default:
            GGML_ABORT("expert cache: unsupported gating function %d", (int) gating);
    }
}

// Gating of one token: the normalised gate weights of its k selected experts (L.w) and the router's scores of
// all experts (returned: their order ranks substitutes). Recomputed from the router logits, as build_moe_ffn
// computes them, because reading the graph's probabilities would break the CUDA topk-moe fusion.
static const float * route_gate(llama_expert_cache_layer & L, const int32_t * id, const float * lg, const float * bias,
        int32_t k, int32_t E, bool need_probs) {
    float * w = L.w.data();
    // router probabilities of all experts, when needed
    if (need_probs) {
        route_probs(L.gating, lg, E, L.probs.data());
    }

    // normalised gate weights of the selected experts
    switch (L.gating) {
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX:
            if (L.norm_w) {
                float m = -INFINITY;
                for (int32_t r = 0; r < k; ++r) { m = std::max(m, lg[id[r]]); }
                for (int32_t r = 0; r < k; ++r) { w[r] = expf(lg[id[r]] - m); }
            } else {
                for (int32_t r = 0; r < k; ++r) { w[r] = L.probs[id[r]]; }
            }
            break;
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT:
            {
                float m = -INFINITY;
                for (int32_t r = 0; r < k; ++r) { m = std::max(m, lg[id[r]]); }
                for (int32_t r = 0; r < k; ++r) { w[r] = expf(lg[id[r]] - m); }
            } break;
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID:
            for (int32_t r = 0; r < k; ++r) { w[r] = 1.0f / (1.0f + expf(-lg[id[r]])); }
            break;
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS:
            for (int32_t r = 0; r < k; ++r) { const float x = lg[id[r]]; w[r] = sqrtf(x > 20.0f ? x : log1pf(expf(x))); }
            break;
        default:
            GGML_ABORT("expert cache: unsupported gating function %d", (int) L.gating);
    }
    const bool normalise = L.norm_w || L.gating == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT;
    if (normalise) {
        float sum = 0.0f;
        for (int32_t r = 0; r < k; ++r) { sum += w[r]; }
        sum = std::max(sum, 6.103515625e-5f);
        for (int32_t r = 0; r < k; ++r) { w[r] /= sum; }
    }

    // router scores: the order in which the router ranks experts
    const float * scores = lg; // softmax, sigmoid and sqrt-softplus are monotonic in the logit
    if (bias) {
        for (int32_t e = 0; e < E; ++e) { L.scores[e] = L.probs[e] + bias[e]; }
        scores = L.scores.data();
    }
    return scores;
}

// Prefetch, at the route step of the predicting layer L: the next MoE layer's top k (its router applied to L's
// input; ranked by logit, or by probability plus selection bias as that layer selects; grouped routing is not
// applied) for every token of the ubatch, into that layer's prediction. Engine, one-token ubatch: applied at
// once, and its copies are issued in the background, so that they overlap the layers in between; otherwise the
// predicted layer applies each token's prediction just before deciding it (the same decisions: nothing else
// changes that layer's residency in between).
static void route_predict(llama_expert_cache_layer & L, const ggml_tensor * dst, int64_t T, bool banked) {
    auto & cache = *L.cache;
    auto & N     = *cache.layers[L.next_moe];
    const ggml_tensor * pl = dst->src[L.src_pred];
    const float * pb = L.src_pred_bias >= 0 ? (const float *) dst->src[L.src_pred_bias]->data : nullptr;
    const int32_t E = cache.n_expert;
    const int32_t k = cache.n_used;
    GGML_ASSERT(pl->ne[0] == E && pl->ne[1] == T);

    N.pred.resize((size_t) T * k);
    N.pred_tokens  = T;
    N.pred_applied = false;
    L.top.resize(E);
    if (pb) {
        L.pred_probs.resize(E);
    }
    for (int64_t t = 0; t < T; ++t) {
        const float * sc = (const float *) ((const char *) pl->data + t*pl->nb[1]);
        if (pb) {
            // the next layer's gating (set when its route step was built, before any compute)
            route_probs(N.gating, sc, E, L.pred_probs.data());
            for (int32_t e = 0; e < E; ++e) { L.pred_probs[e] += pb[e]; }
            sc = L.pred_probs.data();
        }
        for (int32_t e = 0; e < E; ++e) {
            L.top[e] = e;
        }
        std::partial_sort(L.top.begin(), L.top.begin() + k, L.top.end(), [sc](int32_t a, int32_t b) {
            return sc[a] > sc[b] || (sc[a] == sc[b] && a < b);
        });
        std::copy(L.top.begin(), L.top.begin() + k, N.pred.begin() + t*k);
    }

    // (only for a token the predicted layer decides in this graph: its route op set the rows word)
    if (cache.cfg.prefetch && cache.engine && banked && T == 1 && dst->op_params[LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS] == 1) {
        // the predicted layer's previous background copies first: a slot is never overwritten while its copy runs
        cache.engine->complete(N.il, N.policy);
        if (N.policy.prefetch_experts(N.pred.data(), k) > 0) {
            const int32_t none = -1;
            cache.engine->sync(N.il, N.policy, &none, 0); // every change a background copy, waited for at N's step
        }
        N.pred_applied = true;
    }
}

// Engine part of a step: the copies of the ubatch's fetches and admissions, then expert ids -> slot ids in dst
// (banked: one token or a group, computed from the banks); a larger ubatch computes with the full expert
// tensors and the banks only follow the residency.
static void route_engine(llama_expert_cache_layer & L, ggml_tensor * dst, int32_t k, int64_t T, bool banked) {
    auto & cache = *L.cache;
    if (banked) {
        // engine, decode or a group: copy the ubatch's fetches and admissions, then expert ids -> slot ids
        L.fetched.clear();
        for (int64_t t = 0; t < T; ++t) {
            const int32_t * out = (const int32_t *) ((const char *) dst->data + t*dst->nb[1]);
            const uint8_t * act = L.actions.data() + t*k;
            for (int32_t r = 0; r < k; ++r) {
                GGML_ASSERT(act[r] != LLAMA_EXPERT_ACTION_HOST && "light=host is refused in mode=engine");
                if (act[r] != LLAMA_EXPERT_ACTION_DROP) {
                    L.fetched.push_back(out[r]);
                }
            }
        }
        cache.engine->sync(L.il, L.policy, L.fetched.data(), (int32_t) L.fetched.size());
        for (int64_t t = 0; t < T; ++t) {
            int32_t       * out = (int32_t *) ((char *) dst->data + t*dst->nb[1]);
            const uint8_t * act = L.actions.data() + t*k;
            for (int32_t r = 0; r < k; ++r) {
                out[r] = act[r] == LLAMA_EXPERT_ACTION_DROP
                    ? cache.n_slots // the spare slot (zeros); the gate weight is 0
                    : cache.engine->slot_for(L.il, L.policy, out[r]);
            }
        }
    } else {
        // engine, larger ubatch: computed with the full expert tensors; the banks follow the residency
        cache.engine->sync(L.il, L.policy);
    }
}

static void llama_expert_cache_route(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto & L     = *(llama_expert_cache_layer *) userdata;
    auto & cache = *L.cache;

    const auto t_start = std::chrono::steady_clock::now();

    const ggml_tensor * ids    = dst->src[0];
    const ggml_tensor * logits = dst->src[1];
    const ggml_tensor * bias   = L.src_bias >= 0 ? dst->src[L.src_bias] : nullptr;

    const int32_t k   = (int32_t) ids->ne[0];
    const int64_t T   = ids->ne[1];
    const int32_t E   = (int32_t) logits->ne[0];

    GGML_ASSERT(k <= cache.n_used && (cache.trace == nullptr || k == cache.n_used));
    GGML_ASSERT(E == cache.n_expert);

    const bool banked = cache.banked(dst);

    if (cache.engine) {
        // the background copies issued at this layer's previous step have completed (GPU: wait on their event)
        cache.engine->complete(L.il, L.policy);
    }

    if (cache.cfg.bypass > 0 && T >= (int64_t) cache.cfg.bypass) {
        // prefill bypass: stock routing with the full expert tensors, then warm the residency
        L.warm_counts.assign(E, 0);
        L.gate_w.clear(); // not gated on the host
        L.actions.assign((size_t) T * k, LLAMA_EXPERT_ACTION_HIT);
        L.scales.assign((size_t) T * k, 1.0f);
        for (int64_t t = 0; t < T; ++t) {
            const int32_t * id  = (const int32_t *) ((const char *) ids->data + t*ids->nb[1]);
            int32_t       * out = (int32_t *) ((char *) dst->data + t*dst->nb[1]);
            for (int32_t r = 0; r < k; ++r) {
                GGML_ASSERT(id[r] >= 0 && id[r] < E);
                out[r] = id[r];
                L.warm_counts[id[r]]++;
            }
        }
        llama_expert_policy_warm(L.policy, L.warm_counts);
        if (cache.engine) {
            cache.engine->sync(L.il, L.policy);
        }
        L.pred_tokens = -1; // no prefetch for a bypassed ubatch
        L.bypass_tokens += (uint64_t) T;
        L.route_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_start).count();
        return;
    }

    if (L.src_pred >= 0) {
        route_predict(L, dst, T, banked);
    }
    // this layer's prediction, made by the previous MoE layer for this ubatch (a graph whose last layer computes
    // only the output tokens has none for that layer: its rows are not those of the prediction)
    const bool    have_pred  = L.pred_tokens == T;
    const bool    apply_pred = have_pred && cache.cfg.prefetch && !L.pred_applied;
    const int32_t k_pred     = cache.n_used;

    const bool need_probs = bias != nullptr || cache.trace != nullptr ||
        (L.gating == LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX && !L.norm_w);

    // a small multi-token ubatch is decided as a group: every expert one of its tokens computes with stays
    // resident until the end of the ubatch (in engine mode the ubatch computes from the banks)
    const bool group = cache.grouped(T);
    if (group) {
        L.policy.begin_group();
    }

    L.actions.resize((size_t) T * k);
    L.scales.resize((size_t) T * k);
    L.w.resize(k);
    if (cache.test_gating) {
        L.gate_w.resize((size_t) T * k);
    }
    if (need_probs) {
        L.probs.resize(E);
        if (bias) {
            L.scores.resize(E);
        }
    }

    for (int64_t t = 0; t < T; ++t) {
        const int32_t * id = (const int32_t *) ((const char *) ids->data    + t*ids->nb[1]);
        const float   * lg = (const float   *) ((const char *) logits->data + t*logits->nb[1]);
        int32_t       * out = (int32_t *) ((char *) dst->data + t*dst->nb[1]);
        uint8_t       * act = L.actions.data() + t*k;
        float         * sc  = L.scales.data() + t*k;
        float         * w   = L.w.data();

        for (int32_t r = 0; r < k; ++r) {
            GGML_ASSERT(id[r] >= 0 && id[r] < E);
        }

        const float * scores = route_gate(L, id, lg, bias ? (const float *) bias->data : nullptr, k, E, need_probs);
        if (cache.test_gating) {
            std::copy(w, w + k, L.gate_w.data() + t*k);
        }

        if (apply_pred) {
            L.policy.prefetch_experts(L.pred.data() + t*k_pred, k_pred);
        }
        L.policy.decide(id, w, k, scores, out, act, sc);

        if (cache.trace) {
            cache.trace_write(L, (uint32_t) (L.policy.tick - 1), id, w, out, act, bias ? scores : L.probs.data(),
                have_pred ? L.pred.data() + t*k_pred : nullptr);
        }

    }

    if (group) {
        L.policy.end_group();
    }
    L.pred_tokens = -1; // consumed

    if (cache.engine) {
        route_engine(L, dst, k, T, banked);
    }

    L.route_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_start).count();
    L.route_tokens += (uint64_t) T;
}

// LLAMA_MOE_CACHE_TEST_GATING: the graph's gate weights [1, k, n_tokens] (src[1]) against the route step's, as
// the ratio graph/route per selection (min and max over the run; the stats file reports them)
static void llama_expert_cache_check_gating(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto & L = *(llama_expert_cache_layer *) userdata;
    const ggml_tensor * weights = dst->src[1];
    const int64_t k = weights->ne[1];
    const int64_t T = weights->ne[2];
    *(float *) dst->data = 0.0f;
    if ((int64_t) L.gate_w.size() != k*T) {
        return; // a bypassed ubatch: not gated on the host
    }
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t r = 0; r < k; ++r) {
            const float gw = *(const float *) ((const char *) weights->data + r*weights->nb[1] + t*weights->nb[2]);
            const float w  = L.gate_w[t*k + r];
            if (w > 1e-6f) {
                const double ratio = (double) gw / w;
                L.gating_ratio_min = std::min(L.gating_ratio_min, ratio);
                L.gating_ratio_max = std::max(L.gating_ratio_max, ratio);
                L.gating_checked++;
            }
        }
    }
}

static void llama_expert_cache_keep(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const auto & L = *(const llama_expert_cache_layer *) userdata;
    const int64_t n = ggml_nelements(dst);
    GGML_ASSERT((int64_t) L.scales.size() == n);
    // the policy's factors: 0 for a drop or a skip, alpha for a cache-route substitute, renorm, else 1
    std::memcpy(dst->data, L.scales.data(), n * sizeof(float));
}

// host=file, a warmup graph (llama_set_warmup: every expert selected, to page the weights in): every selection
// computes with the banks' spare slot (never written: zeros, so the experts add nothing), so that the warmup reads
// no expert through the mapping
static void llama_expert_cache_spare(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    const int32_t spare = *(const int32_t *) userdata;
    std::fill((int32_t *) dst->data, (int32_t *) dst->data + ggml_nelements(dst), spare);
}

ggml_tensor * llama_expert_cache::build_route(
        ggml_context * ctx,
        ggml_tensor  * ids,
        ggml_tensor  * logits,
        ggml_tensor  * exp_probs_b,
        llama_expert_gating_func_type gating,
        bool           norm_w,
        bool           warmup,
        int            il,
        ggml_tensor ** keep,
        ggml_tensor  * pred_logits,
        ggml_tensor  * pred_bias) {
    *keep = nullptr;

    if (warmup || ids->ne[0] > n_slots || ids->ne[1] == 0) {
        return ids; // warmup (k = n_expert): stock routing, no statistics
    }
    if (il < 0 || il >= n_layer || !layers[il]->moe) {
        throw std::runtime_error(format("expert cache: %s routes experts in layer %d, where the cache found no routed expert "
            "tensors (an MTP or extra expert set): the expert cache cannot serve this graph; run it without the cache "
            "(unset LLAMA_MOE_CACHE, or mode=off)", arch.c_str(), il));
    }
    if (ids->type != GGML_TYPE_I32 || ids->nb[0] != sizeof(int32_t) || ids->ne[2] != 1 || ids->ne[3] != 1) {
        throw std::runtime_error("expert cache: " + arch + " selects experts in a layout the route step does not read "
            "(not I32 [k, n_tokens]): run it without the cache (unset LLAMA_MOE_CACHE, or mode=off)");
    }
    if (logits == nullptr || logits->type != GGML_TYPE_F32 || logits->nb[0] != sizeof(float) || logits->ne[0] != n_expert ||
            logits->ne[1] != ids->ne[1]) {
        throw std::runtime_error("expert cache: " + arch + "'s router logits are not an F32 [n_expert, n_tokens] tensor, "
            "which the route step reads: run it without the cache (unset LLAMA_MOE_CACHE, or mode=off)");
    }
    if (exp_probs_b && (exp_probs_b->type != GGML_TYPE_F32 || ggml_nelements(exp_probs_b) != n_expert || !ggml_is_contiguous(exp_probs_b))) {
        throw std::runtime_error("expert cache: " + arch + "'s expert selection bias is not an F32 vector of n_expert "
            "values, which the route step reads: run it without the cache (unset LLAMA_MOE_CACHE, or mode=off)");
    }
    switch (gating) {
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX:
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID:
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT:
        case LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS:
            break;
        default:
            throw std::runtime_error(format("expert cache: %s gates its experts with function %d, which the route step "
                "does not recompute: run it without the cache (unset LLAMA_MOE_CACHE, or mode=off)", arch.c_str(), (int) gating));
    }

    auto & L = *layers[il];
    L.gating = gating;
    L.norm_w = norm_w;

    // sources: ids, logits, then the optional ones (their indices kept in L: the layout is the same in every graph)
    ggml_tensor * args[5] = { ids, logits };
    int n_args = 2;
    L.src_bias = L.src_pred = L.src_pred_bias = -1;
    if (exp_probs_b) {
        L.src_bias = (int8_t) n_args;
        args[n_args++] = exp_probs_b;
    }
    if (pred_logits && L.next_moe >= 0) {
        GGML_ASSERT(pred_logits->type == GGML_TYPE_F32 && pred_logits->ne[0] == n_expert && pred_logits->ne[1] == ids->ne[1]);
        L.src_pred = (int8_t) n_args;
        args[n_args++] = pred_logits;
        if (pred_bias) {
            L.src_pred_bias = (int8_t) n_args;
            args[n_args++] = pred_bias;
        }
    }
    ggml_tensor * route = ggml_custom_4d(ctx, GGML_TYPE_I32, ids->ne[0], ids->ne[1], 1, 1,
            args, n_args, llama_expert_cache_route, 1, &L);
    ggml_format_name(route, "moe_cache_route-%d", il);
    static_assert(3 * sizeof(void *) <= LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS * sizeof(int32_t),
        "the rows word lies after ggml_custom_op_params");
    route->op_params[LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS] = 0;
    if (L.src_pred >= 0) {
        layers[L.next_moe]->pred_route = route; // the predicted layer's route op, built later in this graph, sets it
    }
    if (L.pred_route) {
        L.pred_route->op_params[LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS] = (int32_t) ids->ne[1];
        L.pred_route = nullptr;
    }

    if (llama_expert_cache_config_scales_weights(cfg)) {
        ggml_tensor * kargs[1] = { route };
        *keep = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, ids->ne[0], ids->ne[1], 1,
                kargs, 1, llama_expert_cache_keep, 1, &L);
        ggml_format_name(*keep, "moe_cache_keep-%d", il);
    }
    return route;
}

void llama_expert_cache::build_moe_ffn_route(const llm_graph_context & g, int il, ggml_tensor * logits,
        ggml_tensor * exp_probs_b, llama_expert_gating_func_type gating, bool norm_w, ggml_tensor *& selected,
        ggml_tensor *& weights, std::initializer_list<ggml_tensor **> expert_tensors) {
    ggml_tensor * keep  = nullptr;
    ggml_tensor * pred_logits = nullptr;
    ggml_tensor * pred_bias   = nullptr;
    if ((cfg.prefetch || trace != nullptr) && !g.cparams.warmup) {
        pred_logits = build_prediction(g, il, logits, &pred_bias);
    }
    ggml_tensor * route = build_route(g.ctx0, selected, logits, exp_probs_b, gating, norm_w, g.cparams.warmup, il, &keep,
            pred_logits, pred_bias);
    const bool warmup_spare = route == selected && g.cparams.warmup && engine && !engine->files.empty() &&
        il >= 0 && il < n_layer && layers[il]->moe;
    if (warmup_spare) {
        ggml_tensor * args[1] = { selected };
        route = ggml_custom_4d(g.ctx0, GGML_TYPE_I32, selected->ne[0], selected->ne[1], 1, 1, args, 1,
                llama_expert_cache_spare, 1, &engine->n_slots);
        ggml_format_name(route, "moe_cache_warmup-%d", il);
    }
    if (route == selected) {
        return;
    }
    // the route step runs on the host
    if (g.backend_cpu) {
        ggml_backend_sched_set_tensor_backend(g.sched, route, g.backend_cpu);
    }
    ggml_build_forward_expand(g.gf, route);
    selected = route;
    if (banked(route) || warmup_spare) {
        // engine: the route step outputs slot ids into the cache banks
        if (g.loras) {
            for (const auto & lora : *g.loras) {
                for (ggml_tensor ** t : expert_tensors) {
                    if (*t && lora.first->get_weight(*t)) {
                        throw std::runtime_error("expert cache: mode=engine does not support LoRA adapters on routed experts");
                    }
                }
            }
        }
        for (ggml_tensor ** t : expert_tensors) {
            *t = bank(il, *t);
        }
    }
    if (test_gating && il >= 0 && il < n_layer && layers[il]->moe && weights->type == GGML_TYPE_F32 &&
            weights->ne[0] == 1 && weights->ne[1] == route->ne[0] && weights->ne[2] == route->ne[1]) {
        ggml_tensor * cargs[2] = { route, weights };
        ggml_tensor * chk = ggml_custom_4d(g.ctx0, GGML_TYPE_F32, 1, 1, 1, 1, cargs, 2,
                llama_expert_cache_check_gating, 1, layers[il].get());
        ggml_format_name(chk, "moe_cache_check_gating-%d", il);
        if (g.backend_cpu) {
            ggml_backend_sched_set_tensor_backend(g.sched, chk, g.backend_cpu);
        }
        ggml_build_forward_expand(g.gf, chk);
    }
    if (keep) {
        if (g.backend_cpu) {
            ggml_backend_sched_set_tensor_backend(g.sched, keep, g.backend_cpu);
        }
        weights = ggml_mul(g.ctx0, weights, keep);
        g.cb(weights, "ffn_moe_weights_kept", il);
    }
}

ggml_tensor * llama_expert_cache::build_prediction(const llm_graph_context & g, int il, ggml_tensor * logits,
        ggml_tensor ** pred_bias) {
    *pred_bias = nullptr;
    if (il < 0 || il >= n_layer || !layers[il]->moe || layers[il]->next_moe < 0 || logits == nullptr) {
        return nullptr;
    }
    // the layer's router input: logits = mul_mat(ffn_gate_inp, cur), possibly plus the router bias
    ggml_tensor * mm = logits;
    if (mm->op == GGML_OP_ADD && mm->src[0] != nullptr) {
        mm = mm->src[0];
    }
    const auto & cur_layer = model->layers[il];
    if (mm->op != GGML_OP_MUL_MAT || mm->src[0] != cur_layer.ffn_gate_inp || mm->src[1] == nullptr) {
        if (cfg.prefetch && !warned_no_prediction) {
            LLAMA_LOG_WARN("%s: prefetch: the router of layer %d is not a plain product with its input (precomputed "
                "probabilities): no prediction from there\n", __func__, il);
            warned_no_prediction = true;
        }
        return nullptr;
    }
    ggml_tensor * cur = mm->src[1];
    const auto & next = model->layers[layers[il]->next_moe];
    if (next.ffn_gate_inp->ne[0] != cur->ne[0] || next.ffn_gate_inp->ne[1] != n_expert) {
        return nullptr;
    }
    ggml_tensor * pl = ggml_mul_mat(g.ctx0, next.ffn_gate_inp, cur); // [n_expert, n_tokens]
    if (next.ffn_gate_inp_b) {
        pl = ggml_add(g.ctx0, pl, next.ffn_gate_inp_b);
    }
    ggml_format_name(pl, "moe_cache_predict-%d", il);
    if (next.ffn_exp_probs_b && next.ffn_exp_probs_b->type == GGML_TYPE_F32 &&
            ggml_nelements(next.ffn_exp_probs_b) == n_expert && ggml_is_contiguous(next.ffn_exp_probs_b)) {
        *pred_bias = next.ffn_exp_probs_b;
    }
    return pl;
}

void llama_expert_cache::chain_abort_callback(bool (*&cb)(void * data), void *& data) {
    if (!engine || engine->files.empty()) {
        return;
    }
    user_abort      = cb;
    user_abort_data = data;
    cb = [](void * p) {
        const auto * cache = (const llama_expert_cache *) p;
        if (cache->engine->failed()) {
            return true; // the read's failure was logged where it happened
        }
        return cache->user_abort != nullptr && cache->user_abort(cache->user_abort_data);
    };
    data = this;
}

void llama_expert_cache::memory_breakdown_add(llama_memory_breakdown & ret) const {
    if (!engine) {
        return;
    }
    for (const auto & [buft, size] : engine->memory_breakdown()) {
        ret[buft].context += size;
    }
}

bool llama_expert_cache::grouped(int64_t n_tokens) const {
    return n_tokens > 1 && n_tokens <= group_max;
}

bool llama_expert_cache::banked(const ggml_tensor * route) const {
    return engine != nullptr && (route->ne[1] == 1 || grouped(route->ne[1]));
}

ggml_tensor * llama_expert_cache::bank(int il, ggml_tensor * src) const {
    GGML_ASSERT(engine);
    return engine->bank(il, src);
}

//
// statistics
//

llama_expert_engine_stats llama_expert_cache::engine_total() const {
    GGML_ASSERT(engine);
    auto e = engine->total();
    for (const auto & L : layers) {
        if (L->moe) {
            const uint64_t bytes = engine->expert_bytes(L->il);
            e.prefetch_bytes        += L->policy.stats.prefetches * bytes;
            e.prefetch_wasted_bytes += L->policy.stats.prefetch_wasted * bytes;
        }
    }
    return e;
}

llama_expert_policy_stats llama_expert_cache::total() const {
    llama_expert_policy_stats t;
    for (const auto & L : layers) {
        if (L->moe) {
            t.add(L->policy.stats);
        }
    }
    return t;
}

static double ratio(uint64_t a, uint64_t b) {
    return b ? (double) a / (double) b : 0.0;
}

void llama_expert_cache::print_stats() const {
    const auto t = total();
    uint64_t route_ns = 0, route_tokens = 0;
    for (const auto & L : layers) {
        route_ns     += L->route_ns;
        route_tokens += L->route_tokens;
    }
    LLAMA_LOG_INFO("%s: expert cache (%s, policy %s, %d/%d slots): %llu token-layers, %llu calls: "
        "hits %.2f%%, misses %.2f%%, fetches %llu, substitutions %llu (%.2f%%, %llu first choices, max weight %.3f), "
        "drops %llu, host computes %llu, skips %llu, admissions %llu, evictions %llu, mean substituted mass %.4f, "
        "route step %.3f us per token-layer\n",
        __func__, llama_expert_cache_mode_name(cfg.mode), cfg.preset.c_str(), n_slots, n_expert,
        (unsigned long long) t.token_layers, (unsigned long long) t.calls,
        100.0 * ratio(t.hits, t.calls), 100.0 * ratio(t.misses, t.calls), (unsigned long long) t.fetches,
        (unsigned long long) t.substitutions, 100.0 * ratio(t.substitutions, t.calls), (unsigned long long) t.subst_first_choice,
        t.max_subst_weight, (unsigned long long) t.drops, (unsigned long long) t.host_computes, (unsigned long long) t.skips,
        (unsigned long long) t.admissions, (unsigned long long) t.evictions,
        t.token_layers ? t.subst_mass_sum / t.token_layers : 0.0, route_tokens ? 1e-3 * route_ns / route_tokens : 0.0);
    if (cfg.prefetch) {
        LLAMA_LOG_INFO("%s: expert cache prefetch: %llu experts prefetched (%.2f per token-layer), %llu used before "
            "eviction (%.1f%%), %llu evicted unused\n", __func__, (unsigned long long) t.prefetches,
            ratio(t.prefetches, t.token_layers), (unsigned long long) t.prefetch_used,
            100.0 * ratio(t.prefetch_used, t.prefetches), (unsigned long long) t.prefetch_wasted);
    }
    if (engine) {
        const auto e = engine_total();
        LLAMA_LOG_INFO("%s: expert cache engine: banks %.2f MiB, %llu experts copied (%.2f MiB in %llu copies, %.3f ms), "
            "%llu in the background (%s, %llu deferred, %.3f ms waited)\n",
            __func__, engine->total_size()/1024.0/1024.0, (unsigned long long) e.copied_experts,
            e.copy_bytes/1024.0/1024.0, (unsigned long long) e.copies, 1e-6 * e.copy_ns,
            (unsigned long long) e.background_experts, engine->async() ? "async" : "synchronous",
            (unsigned long long) e.deferred_experts, 1e-6 * e.wait_ns);
    }
}

// n_tokens: tokens decided (for a total: the most token_layers of any MoE layer)
static void write_stats_obj(FILE * f, const llama_expert_policy_stats & s, uint64_t n_tokens, const char * indent) {
#define LLAMA_EXPERT_COUNTER_JSON(field, metric, help) \
    fprintf(f, "%s\"" #field "\": %llu,\n", indent, (unsigned long long) s.field);
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_JSON)
#undef LLAMA_EXPERT_COUNTER_JSON
    fprintf(f, "%s\"max_subst_weight\": %.9g,\n", indent, s.max_subst_weight);
    fprintf(f, "%s\"subst_mass_sum\": %.17g,\n", indent, s.subst_mass_sum);
    fprintf(f, "%s\"tokens\": %llu,\n", indent, (unsigned long long) n_tokens);
    fprintf(f, "%s\"substituted_mass\": %.17g,\n", indent, s.token_layers ? s.subst_mass_sum / s.token_layers : 0.0);
    fprintf(f, "%s\"fetches_per_token\": %.17g,\n", indent, ratio(s.fetches, n_tokens));
    fprintf(f, "%s\"drop_mass_sum\": %.17g,\n", indent, s.drop_mass_sum);
    fprintf(f, "%s\"hit_rate\": %.17g,\n", indent, ratio(s.hits, s.calls));
    fprintf(f, "%s\"miss_rate\": %.17g,\n", indent, ratio(s.misses, s.calls));
    fprintf(f, "%s\"substitution_rate\": %.17g,\n", indent, ratio(s.substitutions, s.calls));
    fprintf(f, "%s\"mass_hist\": [", indent);
    for (int i = 0; i < LLAMA_EXPERT_MASS_HIST_BINS; ++i) {
        fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long) s.mass_hist[i]);
    }
    fprintf(f, "]\n");
}

static std::string json_str(const std::string & s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            o += '\\'; o += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            o += buf;
        } else {
            o += c;
        }
    }
    return o + "\"";
}

bool llama_expert_cache::write_stats(const std::string & path) const {
    FILE * f = fopen(path.c_str(), "w");
    if (!f) {
        return false;
    }
    fprintf(f, "{\n");
    fprintf(f, "  \"schema\": \"moe-subst/expert-cache-stats\",\n");
    fprintf(f, "  \"schema_version\": %d,\n", LLAMA_EXPERT_STATS_SCHEMA_VERSION);
    fprintf(f, "  \"config\": {\n");
    fprintf(f, "    \"spec\": %s,\n", json_str(cfg.spec).c_str());
    fprintf(f, "    \"mode\": \"%s\",\n", llama_expert_cache_mode_name(cfg.mode));
    fprintf(f, "    \"policy\": \"%s\",\n", cfg.preset.c_str());
    fprintf(f, "    \"rule\": \"%s\",\n", llama_expert_miss_rule_name(cfg.rule));
    fprintf(f, "    \"tau\": %.9g,\n", cfg.tau);
    fprintf(f, "    \"host\": \"%s\",\n", cfg.host_file ? "file" : "ram");
    fprintf(f, "    \"tau_file\": %.9g,\n", cfg.tau_file >= 0.0f ? cfg.tau_file : cfg.tau);
    fprintf(f, "    \"ram_slots\": %d,\n", llama_expert_cache_config_n_ram_slots(cfg, n_expert));
    fprintf(f, "    \"evict\": \"%s\",\n", llama_expert_evict_name(cfg.evict));
    fprintf(f, "    \"admit\": %s,\n", cfg.admit ? "true" : "false");
    fprintf(f, "    \"beta\": %.9g,\n", cfg.beta);
    fprintf(f, "    \"lfu_halve\": %u,\n", cfg.lfu_halve);
    fprintf(f, "    \"classlru_half_life\": %u,\n", cfg.classlru_half_life);
    fprintf(f, "    \"classlru_classes\": %u,\n", cfg.classlru_classes);
    fprintf(f, "    \"route_j\": %d,\n", cfg.route_j);
    fprintf(f, "    \"route_m\": %d,\n", cfg.route_m > 0 ? cfg.route_m : std::min(n_expert, 2*n_used));
    fprintf(f, "    \"route_alpha\": %.9g,\n", cfg.route_alpha);
    fprintf(f, "    \"ser_kmin\": %d,\n", cfg.ser_kmin);
    fprintf(f, "    \"ser_t\": %.9g,\n", cfg.ser_t);
    fprintf(f, "    \"renorm\": %s,\n", cfg.renorm ? "true" : "false");
    fprintf(f, "    \"light\": \"%s\",\n", cfg.light_host ? "host" : "substitute");
    fprintf(f, "    \"prefetch\": %s,\n", cfg.prefetch ? "true" : "false");
    fprintf(f, "    \"slots\": %d,\n", n_slots);
    fprintf(f, "    \"n_expert\": %d,\n", n_expert);
    fprintf(f, "    \"n_expert_used\": %d,\n", n_used);
    fprintf(f, "    \"profile\": %s\n", json_str(cfg.profile).c_str());
    fprintf(f, "  },\n");
    fprintf(f, "  \"mass_hist_edges\": [");
    for (int i = 0; i <= LLAMA_EXPERT_MASS_HIST_BINS; ++i) {
        fprintf(f, "%s%.9g", i ? ", " : "", (double) i / LLAMA_EXPERT_MASS_HIST_BINS);
    }
    fprintf(f, "],\n");
    uint64_t route_ns = 0, route_tokens = 0;
    for (const auto & L : layers) {
        route_ns     += L->route_ns;
        route_tokens += L->route_tokens;
    }
    if (engine) {
        const auto e = engine_total();
        fprintf(f, "  \"engine\": {\"bank_bytes\": %llu, ", (unsigned long long) engine->total_size());
#define LLAMA_EXPERT_COUNTER_JSON(field, metric, help) \
        fprintf(f, "\"" #field "\": %llu, ", (unsigned long long) e.field);
        LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_JSON)
#undef LLAMA_EXPERT_COUNTER_JSON
        fprintf(f, "\"async\": %s},\n", engine->async() ? "true" : "false");
    }
    fprintf(f, "  \"group_max\": %d,\n", group_max);
    uint64_t bypass_tl = 0;
    for (const auto & L : layers) {
        bypass_tl += L->bypass_tokens;
    }
    fprintf(f, "  \"bypass\": %u,\n", cfg.bypass);
    fprintf(f, "  \"bypass_token_layers\": %llu,\n", (unsigned long long) bypass_tl);
    fprintf(f, "  \"route_ns\": %llu,\n", (unsigned long long) route_ns);
    fprintf(f, "  \"route_ns_per_token_layer\": %.6g,\n", route_tokens ? (double) route_ns / route_tokens : 0.0);
    if (test_gating) {
        uint64_t checked = 0;
        double rmin = 1e300, rmax = -1e300;
        for (const auto & L : layers) {
            checked += L->gating_checked;
            rmin = std::min(rmin, L->gating_ratio_min);
            rmax = std::max(rmax, L->gating_ratio_max);
        }
        fprintf(f, "  \"gating_check\": {\"checked\": %llu, \"ratio_min\": %.9g, \"ratio_max\": %.9g},\n",
            (unsigned long long) checked, checked ? rmin : 0.0, checked ? rmax : 0.0);
    }
    fprintf(f, "  \"total\": {\n");
    // tokens decided: those that reached the first MoE layer (graphs may skip unused tokens in the last layer)
    uint64_t n_tokens = 0;
    for (const auto & L : layers) {
        if (L->moe) {
            n_tokens = std::max(n_tokens, L->policy.stats.token_layers);
        }
    }
    const auto t = total();
    write_stats_obj(f, t, n_tokens, "    ");
    fprintf(f, "  },\n");
    fprintf(f, "  \"layers\": [");
    bool first = true;
    for (const auto & L : layers) {
        if (!L->moe) {
            continue;
        }
        fprintf(f, "%s\n    {\n      \"layer\": %d,\n", first ? "" : ",", L->il);
        write_stats_obj(f, L->policy.stats, L->policy.stats.token_layers, "      ");
        fprintf(f, "    }");
        first = false;
    }
    fprintf(f, "\n  ]\n}\n");
    const bool ok = !ferror(f);
    return fclose(f) == 0 && ok;
}
