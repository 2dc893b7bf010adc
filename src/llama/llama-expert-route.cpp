#include "llama-expert-cache-impl.h"
#include "llama-expert-writer.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model.h"

#include "ggml.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>

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
// applied) for every token of the ubatch, into that layer's prediction. Engine, one-token ubatch: applied at the end
// of L's step (route_prefetch), and its copies are issued in the background, so that they overlap the layers in
// between; otherwise the predicted layer applies each token's prediction just before deciding it (the same
// decisions: nothing else changes that layer's residency in between).
static void route_predict(llama_expert_cache_layer & L, const ggml_tensor * dst, int64_t T) {
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
}

// Prefetch in engine mode, for a one-token ubatch (decode), at the end of the predicting layer L's route step: the
// predicted layer's predicted experts admitted and their copies issued in the background, after L's own fetches
// (which therefore never wait behind them), so that they overlap the compute of L and of the layers in between;
// only for a token the predicted layer decides in this graph (its route op set the rows word).
static void route_prefetch(llama_expert_cache_layer & L, const ggml_tensor * dst, int64_t T, bool banked) {
    auto & cache = *L.cache;
    auto & N     = *cache.layers[L.next_moe];
    const int32_t k = cache.n_used;
    if (cache.cfg.prefetch && cache.engine && banked && T == 1 && N.pred_tokens == T &&
            dst->op_params[LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS] == 1) {
        // the predicted layer's previous background copies first: a slot is never overwritten while its copy runs
        // (its prefetch reads were settled at its last step; settled here too should that step not have run)
        cache.engine->complete(N.il, N.policy);
        cache.engine->settle_prefetch(N.il, N.policy);
        if (N.policy.prefetch_experts(N.pred.data(), k) > 0) {
            const int32_t none = -1;
            // every change a background copy: host=file, a droppable prefetch read (settled at N's step, after N has
            // decided); otherwise waited for at N's step
            cache.engine->sync(N.il, N.policy, &none, 0, /*prefetch =*/ true);
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
        // host=file: this layer's prefetch reads, now that the ubatch is decided: those not started are cancelled
        // (read now as fetches when the ubatch uses them, dropped otherwise), so no fetch waits behind them
        cache.engine->settle_prefetch(L.il, L.policy, L.fetched.data(), (int32_t) L.fetched.size());
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
        cache.engine->settle_prefetch(L.il, L.policy);
        cache.engine->sync(L.il, L.policy);
    }
}

// once a ubatch at the first MoE layer (the files' check, profile_every=), and at every layer the completion of the
// background copies issued at its previous step
static void route_step_begin(llama_expert_cache_layer & L, llama_expert_cache_impl & cache) {
    if (cache.engine && L.il == cache.first_moe && !cache.engine->files.empty()) {
        // host=file, once per ubatch: a model file changed in place is marked failed, and the cache's abort callback
        // ends this compute (the loader's mapping of the other weights is the changed file too)
        cache.engine->check_files();
    }
    if (L.il == cache.first_moe && cache.cfg.profile_every > 0 &&
            L.route_tokens + L.bypass_tokens >= cache.profile_written_tokens + cache.cfg.profile_every) {
        // profile_every=: what the run has learned so far, before this ubatch
        cache.profile_written_tokens = L.route_tokens + L.bypass_tokens;
        if (!llama_expert_write_replacing(cache.cfg.profile_out, [&](const std::string & p) { return cache.write_profile(p); })) {
            LLAMA_LOG_WARN("expert cache: profile_every=%u: the profile could not be written to %s (%s)\n",
                cache.cfg.profile_every, cache.cfg.profile_out.c_str(), strerror(errno));
        }
    }
    if (cache.engine) {
        // the background copies issued at this layer's previous step have completed (GPU: wait on their event)
        cache.engine->complete(L.il, L.policy);
    }
}

// prefill bypass: stock routing with the full expert tensors, then warm the residency
static void route_bypass(llama_expert_cache_layer & L, llama_expert_cache_impl & cache, ggml_tensor * dst,
        const ggml_tensor * ids, int64_t T, int32_t k, int32_t E) {
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
    if (cache.engine) {
        cache.engine->settle_prefetch(L.il, L.policy); // (before the residency changes)
    }
    llama_expert_policy_warm(L.policy, L.warm_counts);
    if (cache.engine) {
        cache.engine->sync(L.il, L.policy);
    }
    L.pred_tokens = -1; // no prefetch for a bypassed ubatch
    L.bypass_tokens += (uint64_t) T;
}

// shadow=, the exact pass: the router's experts and gate weights as they are, and nothing counted or changed
static void route_exact(llama_expert_cache_layer & L, ggml_tensor * dst, const ggml_tensor * ids, int64_t T, int32_t k) {
    for (int64_t t = 0; t < T; ++t) {
        std::memcpy((char *) dst->data + t*dst->nb[1], (const char *) ids->data + t*ids->nb[1], k * sizeof(int32_t));
    }
    L.scales.assign((size_t) T * k, 1.0f);
}

static void llama_expert_cache_route(ggml_tensor * dst, int ith, int nth, void * userdata) {
    GGML_UNUSED(nth);
    if (ith != 0) {
        return;
    }
    auto & L     = *(llama_expert_cache_layer *) userdata;
    auto & cache = *L.cache;
    std::lock_guard<std::mutex> lock(cache.state_mtx); // against the writer thread (llama-expert-writer.h)

    const auto t_start = std::chrono::steady_clock::now();

    const ggml_tensor * ids    = dst->src[0];
    const ggml_tensor * logits = dst->src[1];
    const ggml_tensor * bias   = L.src_bias >= 0 ? dst->src[L.src_bias] : nullptr;

    const int32_t k   = (int32_t) ids->ne[0];
    const int64_t T   = ids->ne[1];
    const int32_t E   = (int32_t) logits->ne[0];

    GGML_ASSERT(k <= cache.n_used && (cache.trace == nullptr || k == cache.n_used));
    GGML_ASSERT(E == cache.n_expert);

    if (cache.shadow_active()) {
        route_exact(L, dst, ids, T, k);
        return;
    }

    const bool banked = cache.banked(dst);

    route_step_begin(L, cache);

    if (cache.cfg.bypass > 0 && T >= (int64_t) cache.cfg.bypass) {
        route_bypass(L, cache, dst, ids, T, k, E);
        L.route_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t_start).count();
        return;
    }

    if (L.src_pred >= 0) {
        route_predict(L, dst, T);
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
        if (cache.replay) {
            // tests and benchmarks: this token-layer's experts and gate weights from a recorded trace (the router's
            // scores stay the model's: a substitute is still chosen among resident experts by them)
            GGML_ASSERT(k == cache.n_used);
            L.replay_ids.resize(k);
            cache.replay->next(L.il, L.replay_ids.data(), w);
            id = L.replay_ids.data();
        }
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
        if (L.src_pred >= 0) {
            route_prefetch(L, dst, T, banked);
        }
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
    *(float *) dst->data = 0.0f;
    if (L.cache->shadow_active()) {
        return; // the exact pass: the route step did not gate this ubatch
    }
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

static void llama_expert_cache_scale(ggml_tensor * dst, int ith, int nth, void * userdata) {
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

ggml_tensor * llama_expert_cache_impl::build_route(
        ggml_context * ctx,
        ggml_tensor  * ids,
        ggml_tensor  * logits,
        ggml_tensor  * exp_probs_b,
        llama_expert_gating_func_type gating,
        bool           norm_w,
        bool           warmup,
        int            il,
        ggml_tensor ** scale,
        ggml_tensor  * pred_logits,
        ggml_tensor  * pred_bias) {
    *scale = nullptr;

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
        *scale = ggml_custom_4d(ctx, GGML_TYPE_F32, 1, ids->ne[0], ids->ne[1], 1,
                kargs, 1, llama_expert_cache_scale, 1, &L);
        ggml_format_name(*scale, "moe_cache_scale-%d", il);
    }
    return route;
}

void llama_expert_cache_impl::build_moe_ffn_route(const llm_graph_context & g, int il, ggml_tensor * logits,
        ggml_tensor * exp_probs_b, llama_expert_gating_func_type gating, bool norm_w, ggml_tensor *& selected,
        ggml_tensor *& weights, std::initializer_list<ggml_tensor **> expert_tensors) {
    ggml_tensor * scale = nullptr;
    ggml_tensor * pred_logits = nullptr;
    ggml_tensor * pred_bias   = nullptr;
    if ((cfg.prefetch || trace != nullptr) && !g.cparams.warmup) {
        pred_logits = build_prediction(g, il, logits, &pred_bias);
    }
    ggml_tensor * route = build_route(g.ctx0, selected, logits, exp_probs_b, gating, norm_w, g.cparams.warmup, il, &scale,
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
    if (scale) {
        if (g.backend_cpu) {
            ggml_backend_sched_set_tensor_backend(g.sched, scale, g.backend_cpu);
        }
        weights = ggml_mul(g.ctx0, weights, scale);
        g.cb(weights, "ffn_moe_weights_kept", il);
    }
}

ggml_tensor * llama_expert_cache_impl::build_prediction(const llm_graph_context & g, int il, ggml_tensor * logits,
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

