#pragma once

// The MoE expert cache (moe-subst), behind the hooks of llama-expert-cache.h: configuration from LLAMA_MOE_CACHE, the
// per-layer route step placed in the graph after the router, statistics and the router trace. Its rooms:
// llama-expert-cache.cpp (construction, the hooks, reset), llama-expert-route.cpp (the route step and the graph),
// llama-expert-trace.cpp (the router trace), llama-expert-report.cpp (the statistics' summary and JSON).
//
// Mode "emulate": the route step runs the residency policy (llama-expert-policy.h) on the host and
// outputs the expert ids that the expert ops compute with (a substitute in place of a missed expert,
// with the missed expert's gate weight). No memory is moved; the model computes exactly what an
// engine with that policy would compute. See docs/expert-cache.md of the moe-subst project.

#include "llama-expert-engine.h"
#include "llama-expert-policy.h"
#include "llama-expert-replay.h"
#include "llama-expert-shadow.h"
#include "llama-cparams.h"
#include "llama-ext.h"
#include "llama-hparams.h"

#include <cstdio>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

struct ggml_context;
struct ggml_tensor;
struct llama_memory_i;
struct llama_model;
struct llm_graph_context;

#define LLAMA_EXPERT_CACHE_ENV "LLAMA_MOE_CACHE"

#define LLAMA_EXPERT_STATS_SCHEMA_VERSION 1
// the route op's op_params word (int32 index, after ggml's custom-op parameters) that holds the rows of the predicted
// layer's route op in the same graph (prefetch)
#define LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS 12

#define LLAMA_EXPERT_TRACE_VERSION        2 // 2: + the prefetch prediction per record (1 is still read)

struct llama_expert_cache_impl;

// per-layer state; its address is stable for the lifetime of the cache (it is the route op's userdata)
struct llama_expert_cache_layer {
    llama_expert_cache_impl * cache = nullptr;

    int32_t il  = -1;
    bool    moe = false; // the layer has routed experts

    llama_expert_layer_policy policy;

    // router description, set when the graph is built
    llama_expert_gating_func_type gating = LLAMA_EXPERT_GATING_FUNC_TYPE_NONE;
    bool norm_w = false;

    // host time spent in the route step (ns) and the token-layers it decided
    uint64_t route_ns     = 0;
    uint64_t route_tokens = 0;

    // token-layers that took the prefill bypass (bypass=N), and the bypass's selection counts (scratch)
    uint64_t bypass_tokens = 0;
    std::vector<uint32_t> warm_counts;

    // LLAMA_MOE_CACHE_TEST_REPLAY: the replayed token's expert ids (scratch, k)
    std::vector<int32_t> replay_ids;
    std::vector<int32_t>  fetched; // engine: the experts a ubatch computes with (scratch)

    // actions of the last ubatch, [n_tokens][k], and the factors for the gate weights (llama_expert_layer_policy::decide)
    std::vector<uint8_t> actions;
    std::vector<float>   scales;

    // prefetch (prefetch=on, or a trace): the next MoE layer (-1: none, or this layer's router input was not found
    // when the graph was built), and where the route op finds its sources (-1: absent)
    int32_t next_moe       = -1;
    int8_t  src_bias       = -1; // this layer's selection bias (exp_probs_b)
    int8_t  src_pred       = -1; // the next MoE layer's router logits on this layer's input, [n_expert, n_tokens]
    int8_t  src_pred_bias  = -1; // the next MoE layer's selection bias

    // the prediction for this layer, made by the previous MoE layer's route step in the same graph: the k
    // experts per token of its ubatch ([pred_tokens][k]); pred_tokens -1: none; pred_applied: already prefetched
    // (engine, one-token ubatches: at the predicting layer's step, so that the copies overlap the layers between)
    std::vector<int32_t> pred;
    int64_t pred_tokens  = -1;
    bool    pred_applied = false;
    // graph build: the predicting layer's route op in the graph being built, whose op_params word
    // LLAMA_EXPERT_ROUTE_PARAM_PRED_ROWS this layer's route op sets to its rows (0 when this layer has no route op
    // in that graph, e.g. a last layer computing no output token): the predicting layer prefetches early only for
    // a token this layer decides, as emulate mode does
    ggml_tensor * pred_route = nullptr;

    // scratch
    std::vector<float>   probs;
    std::vector<float>   scores;
    std::vector<float>   w;
    std::vector<int32_t> top;
    std::vector<float>   pred_probs;

    // LLAMA_MOE_CACHE_TEST_GATING (tests): the route step's gate weights of the last ubatch, [n_tokens][k], and the
    // ratio of the graph's weights to them over the run (1, or the model's expert_weights_scale, when they agree)
    std::vector<float> gate_w;
    uint64_t gating_checked   = 0;
    double   gating_ratio_min = 1e300;
    double   gating_ratio_max = -1e300;
};

// what the cache's policies need of a model (no tensors): a model's (llama_expert_cache_impl's constructor measures
// it) or a router trace's (llama-moe-sim)
struct llama_expert_model_shape {
    int32_t           n_layer  = 0; // including MTP/nextn layers
    int32_t           n_expert = 0;
    int32_t           n_used   = 0; // experts per token (k)
    std::vector<bool> moe;          // per layer: it has routed experts
    std::string       arch;         // for error messages
    bool              dry_run  = false; // a memory-fitting dry run: nothing written, printed or traced
};

struct llama_expert_cache_impl {
    // throws std::runtime_error with a clear message when the configuration cannot apply to the model
    // ctx_mem: the context's memory (KV cache) per buffer type, for a residency given as a budget (vram=)
    llama_expert_cache_impl(const llama_expert_cache_config & cfg, const llama_model & model,
                       const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem = {});

    // without a model (llama-moe-sim): the policies, statistics, profiles of mode=emulate; no graph is ever built.
    // Throws for another mode or a residency budget (vram=, ram=: they need the model's memory).
    llama_expert_cache_impl(const llama_expert_cache_config & cfg, const llama_expert_model_shape & shape);
    ~llama_expert_cache_impl();

    // read the spec from LLAMA_MOE_CACHE; null when unset or mode=off; throws on a bad spec.
    // memory: the context's memory (KV cache; may be null), whose size a residency budget (vram=) accounts for.
    // The hook in llama_context's constructor.
    static std::unique_ptr<llama_expert_cache_impl> from_env(const llama_model & model, const llama_memory_i * memory,
            const llama_cparams & cparams);

    // The hook in llm_graph_context::build_moe_ffn, after the router: builds the route step of layer il
    // (build_route) and rewires the layer's expert computation to it: `selected` becomes the route step's ids
    // (experts in emulate mode, cache slots in engine mode, where every routed-expert tensor of the layer in
    // `expert_tensors` is replaced by its cache bank), `weights` is multiplied by the policy's factors (drops and
    // skips 0, cache-route's alpha, renorm) when the rule can change them.
    // Unchanged when no route step applies (warmup, more experts per token than slots).
    void build_moe_ffn_route(const llm_graph_context & g, int il, ggml_tensor * logits, ggml_tensor * exp_probs_b,
            llama_expert_gating_func_type gating, bool norm_w, ggml_tensor *& selected, ggml_tensor *& weights,
            std::initializer_list<ggml_tensor **> expert_tensors);

    // The hook in llama_context::memory_breakdown: the cache banks count as per-context memory, like the KV cache
    void memory_breakdown_add(llama_memory_breakdown & ret) const;

    // The hook in llama_context::set_abort_callback (host=file): the backends get the cache's abort callback,
    // which ends a compute once a read from the model file has failed (llama_decode returns 2: a clear error,
    // not a crash and not a wrong answer) and otherwise asks the user's callback, kept here. cb and data are
    // replaced; unchanged when the cache reads no file.
    void chain_abort_callback(bool (*&cb)(void * data), void *& data);

    // back to the initial residency, clear statistics, restart the trace (called by llama_perf_context_reset,
    // so that a warmup run does not count)
    void reset();

    // Build the route step for layer il (pred_logits: build_prediction's, a source of the route op). ids: the selected experts [k, n_tokens] (I32); logits: the router
    // logits [n_expert, n_tokens] (F32, after any router bias); exp_probs_b: the selection bias or null.
    // Returns the ids tensor the expert ops must use, or `ids` itself when no route step applies to this
    // graph (warmup, or more experts per token than slots). When the rule can change the gate weights (drops,
    // skips, alpha, renorm: llama_expert_cache_config_scales_weights), *scale is set to an F32 [1, k, n_tokens]
    // tensor of factors for the gate weights (else null).
    ggml_tensor * build_route(
            ggml_context * ctx,
            ggml_tensor  * ids,
            ggml_tensor  * logits,
            ggml_tensor  * exp_probs_b,
            llama_expert_gating_func_type gating,
            bool           norm_w,
            bool           warmup,
            int            il,
            ggml_tensor ** scale,
            ggml_tensor  * pred_logits = nullptr,
            ggml_tensor  * pred_bias   = nullptr);

    // prefetch (prefetch=on, or a trace): the next MoE layer's router logits on layer il's router input (found as
    // the src[1] of logits' product with ffn_gate_inp, before any router bias), [n_expert, n_tokens]; *pred_bias:
    // that layer's selection bias, or null. Null when layer il has no next MoE layer or its input is not found.
    ggml_tensor * build_prediction(const llm_graph_context & g, int il, ggml_tensor * logits, ggml_tensor ** pred_bias);
    bool warned_no_prediction = false;

    llama_expert_policy_stats total() const;

    // the engine's counters summed over layers, with the bytes of the prefetched experts (policy counts times
    // the layer's bytes per expert)
    llama_expert_engine_stats engine_total() const;

    const llama_model * model = nullptr; // the model's router weights predict the next layer (prefetch)

    // mode=engine: real cache banks (null in emulate mode)
    std::unique_ptr<llama_expert_engine> engine;

    // whether a ubatch of n_tokens is decided as a group (2 <= n_tokens <= group_max): the experts its tokens
    // compute with are held resident together until its end
    bool grouped(int64_t n_tokens) const;

    // mode=engine: whether the expert ops of a graph whose route step is `route` use the cache banks (one token
    // per ubatch, or a group); larger ubatches compute with the full expert tensors
    bool banked(const ggml_tensor * route) const;

    // mode=engine: the cache bank of a layer's expert tensor (null for null)
    ggml_tensor * bank(int il, ggml_tensor * src) const;

    void print_stats() const;
    bool write_stats(const std::string & path) const;
    bool write_profile(const std::string & path) const; // profile_out's format (llama-expert-profile.h)

    // The files written during a run (llama-expert-writer.h): stats= and profile_out= now, from any thread, each
    // through a temporary file renamed over it; why: the log line's reason. Takes state_mtx.
    void write_files_now(const char * why);
    // the policies, counters and banks, against the writer thread: held by the route step and reset()
    std::mutex state_mtx;
    bool       writer_added = false; // the writer thread may write this cache's files (until its destructor)
    uint64_t   profile_written_tokens = 0; // profile_every=: the first MoE layer's tokens at the last write

    llama_expert_cache_config cfg;

    int32_t n_layer  = 0;
    int32_t n_expert = 0;
    int32_t n_used   = 0; // experts per token (k)
    int32_t n_slots  = 0;
    int32_t group_max = 1; // largest ubatch decided as a group (group key; group_max*n_used <= n_slots)
    bool    dry_run   = false; // a memory-fitting dry run (-fit's probe): no statistics, profile or trace written
    std::string arch; // the model's architecture, for error messages
    std::unique_ptr<llama_expert_replay> replay; // LLAMA_MOE_CACHE_TEST_REPLAY (tests, benchmarks): routing from a trace
    bool    test_gating = false; // LLAMA_MOE_CACHE_TEST_GATING: compare the route step's gate weights with the graph's
    std::unique_ptr<llama_expert_shadow> shadow; // shadow=: the measured cost (llama-expert-shadow.h); null when off
    bool shadow_active() const { return shadow && shadow->active; } // the exact pass: route steps pass through

    std::vector<std::unique_ptr<llama_expert_cache_layer>> layers;
    int32_t first_moe = -1; // the first MoE layer, whose route step checks the model files once per ubatch (host=file)

    // router trace
    FILE *   trace       = nullptr;
    // chain_abort_callback: the user's abort callback
    bool (*user_abort)(void * data) = nullptr;
    void * user_abort_data          = nullptr;

    uint32_t trace_top   = 0;
    uint32_t trace_rsize = 0;
    uint64_t trace_fingerprint = 0; // of the model (llama-expert-fingerprint.h), in the trace header; 0: none

    void trace_open();

    // construction, in steps that both constructors share
    void    init_shape(const llama_expert_model_shape & shape, const std::string & prefix);
    int32_t init_policies(const llama_expert_model_shape & shape, const std::string & prefix); // returns the MoE layers
    void    init_end(int32_t n_moe);
    void trace_write(const llama_expert_cache_layer & L, uint32_t token, const int32_t * ids, const float * w,
                     const int32_t * out, const uint8_t * act, const float * scores, const int32_t * pred);
};

// The plan line of `--moe-cache auto` that the model's last context logged ("<spec>: <why>", "off: <why>"); "" when that
// context was not created with auto (llama_expert_cache_auto_plan: llama-server's /props, llama-cli's banner)
std::string llama_expert_cache_auto_line(const llama_model & model);
