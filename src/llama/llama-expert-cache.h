#pragma once

// The MoE expert cache (moe-subst): the hooks that upstream llama.cpp calls. This is the only header of ours that the
// patches include (patches/0004: src/llama-context.cpp and src/llama-graph.cpp; 0011: src/llama.cpp): an opaque
// handle and seven hooks, each named with its call site. The cache itself (its configuration, policy, engine, copier threads and mutexes) is
// behind the handle, in llama-expert-cache-impl.h, which upstream objects never see.
//
// To add a hook: a method here that forwards to the cache, its call site in a patch (scripts/patches.sh), a line in
// patches/README.md; upstream files get call sites only (docs/extending.md).

#include "llama-cparams.h" // llama_cparams
#include "llama-ext.h"     // llama_memory_breakdown
#include "llama-hparams.h" // llama_expert_gating_func_type

#include "ggml-backend.h"   // ggml_status, ggml_backend_sched_t

#include <functional>

#include <initializer_list>
#include <memory>

struct ggml_tensor;
struct llama_memory_i;
struct llama_ubatch;
struct llama_model;
struct llm_graph_context;
struct llama_expert_cache_impl;

struct llama_expert_cache {
    explicit llama_expert_cache(std::unique_ptr<llama_expert_cache_impl> impl);
    ~llama_expert_cache();

    // Call site: llama_model_load_from_file_impl (src/llama.cpp), once a model is loaded. The path of the model file
    // as the application gave it (a split model's first part; "" for a model loaded from a FILE * or built from the
    // user's metadata): `--moe-cache auto` looks for the model's tuned profile next to it (llama-expert-tuned.h).
    static void model_loaded(const llama_model & model, const char * path);

    // Call site: llama_context::llama_context, after the memory (KV cache) is created. The cache configured by the
    // LLAMA_MOE_CACHE environment variable; null when it is unset or mode=off. memory: the context's memory (may be
    // null), whose size a residency budget (vram=, ram=) accounts for; cparams: the context's sizes (n_ctx, n_batch,
    // n_ubatch), from which `--moe-cache auto` estimates the compute buffers and logits. Throws std::runtime_error
    // with a one-line message on a bad spec or a configuration the model cannot take (the context is then not created).
    static std::unique_ptr<llama_expert_cache> from_env(const llama_model & model, const llama_memory_i * memory,
            const llama_cparams & cparams);

    // Call site: llm_graph_context::build_moe_ffn, after the router has selected the experts. Builds layer il's
    // route step and rewires the layer's expert computation to it: `selected` becomes the route step's ids (experts
    // in emulate mode, cache slots in engine mode, where every routed-expert tensor in `expert_tensors` is replaced
    // by its cache bank), `weights` is multiplied by the policy's factors when the rule can change them. Unchanged
    // when no route step applies (warmup, more experts per token than slots).
    void build_moe_ffn_route(const llm_graph_context & g, int il, ggml_tensor * logits, ggml_tensor * exp_probs_b,
            llama_expert_gating_func_type gating, bool norm_w, ggml_tensor *& selected, ggml_tensor *& weights,
            std::initializer_list<ggml_tensor **> expert_tensors);

    // Call site: llama_context::process_ubatch, in place of its graph_compute(). compute(again) computes the
    // ubatch's graph (again: its inputs set once more first, as a graph's inputs may share memory with its
    // intermediate results); with shadow= every that many ubatches it is computed twice, first exactly (every miss computed
    // with the missed expert, nothing counted), then as the cache serves it, and the two logits compared
    // (llama-expert-shadow.h). t_logits: the graph's logits, or null; sched: the context's scheduler.
    ggml_status compute_ubatch(const llama_ubatch & ubatch, ggml_tensor * t_logits, ggml_backend_sched_t sched,
            const std::function<ggml_status(bool again)> & compute);

    // Call site: llama_context::memory_breakdown. The cache banks count as per-context memory, like the KV cache.
    void memory_breakdown_add(llama_memory_breakdown & ret) const;

    // Call site: llama_context::set_abort_callback (and the constructor, once the cache exists). The backends get
    // the cache's abort callback, which ends a compute once a read from the model file has failed (llama_decode
    // returns 2) and otherwise asks the user's callback (cb, data), kept by the cache; cb and data are replaced.
    // Unchanged when the cache reads no file.
    void chain_abort_callback(bool (*&cb)(void * data), void *& data);

    // Call site: llama_perf_context_reset (e.g. after a warmup run). Back to the initial residency; statistics
    // cleared; the trace restarted.
    void reset();

    // the cache, for our own code (the C API, llama-moe-sim); upstream code never dereferences it
    std::unique_ptr<llama_expert_cache_impl> impl;
};
