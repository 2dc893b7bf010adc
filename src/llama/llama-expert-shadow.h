#pragma once

// The shadow estimate (moe-subst; the `shadow` spec key): the cache measures what its decisions cost while it runs.
// Every `shadow` ubatches (of those with an output), the ubatch is computed twice: first exactly (the route steps pass the router's experts
// through: every miss computed with the missed expert, nothing counted, no residency or policy state changed), then
// as the cache serves it. The served pass runs last, so the memory (KV cache) and the logits the caller reads are
// the served ones: the run is the run it would be without the estimate, one ubatch in `shadow` computed twice.
//
// Per output row of a shadowed ubatch the two next-token distributions give
//   - KL(exact || served) in nats, and
//   - the NLL difference on the actual next token (served NLL - exact NLL): the next token of the ubatch, or the
//     first token of the next ubatch (decode: the token that was sampled), when it continues the same sequence.
// The estimate of the run's delta-PPL is exp(mean NLL difference) - 1, with a 95% interval over the shadowed ubatches
// (the ubatch is the sample: its rows share their history). What it does not see: the served history. The exact
// pass attends to the served KV of earlier tokens, so the estimate is the cost of the current token's decisions
// given the served context, not the drift of a whole served run (docs/expert-cache.md, "The shadow estimate").
// Recurrent and hybrid models: their recurrent state, which a compute advances in place, is saved before the exact
// pass and restored after it (`state`), so that the served pass starts from the state a run without it has.

#include "ggml-backend.h"

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

struct llama_ubatch;

// mean with a two-sided 95% t interval over samples (the shadowed ubatches)
struct llama_expert_shadow_mean {
    uint64_t n    = 0;
    double   mean = 0.0;
    double   low  = 0.0;
    double   high = 0.0;
};

struct llama_expert_shadow_summary {
    uint32_t every    = 0;  // the shadow key: every that many ubatches (0: off)
    uint64_t ubatches = 0;  // ubatches computed twice
    uint64_t rows     = 0;  // output rows compared (KL)
    uint64_t pairs    = 0;  // rows whose actual next token was known (NLL difference)
    llama_expert_shadow_mean kl;       // nats per row
    llama_expert_shadow_mean dnll;     // nats per token
    double dppl_pct      = 0.0;        // 100 * (exp(dnll.mean) - 1)
    double dppl_pct_low  = 0.0;
    double dppl_pct_high = 0.0;
    double shadow_ms     = 0.0;        // time spent in the exact passes and the comparison
};

struct llama_expert_shadow {
    explicit llama_expert_shadow(uint32_t every) : every(every) {}

    // the route steps pass the router's experts through while this is true (the exact pass)
    bool active = false;

    // recurrent and hybrid models: the state tensors that a compute advances in place (the recurrent memory's
    // r_l and s_l); the exact pass's writes to them are undone before the served pass (saved and restored whole)
    std::vector<ggml_tensor *> state;

    // In place of the context's graph_compute for one ubatch: compute() once, or, when the estimate is due, twice as
    // described above. t_logits: the graph's logits [n_vocab, n_outputs] (null: nothing compared, computed once).
    ggml_status compute_ubatch(const llama_ubatch & ubatch, ggml_tensor * t_logits, ggml_backend_sched_t sched,
            const std::function<ggml_status(bool again)> & compute);

    llama_expert_shadow_summary summary() const;
    void reset();

  private:
    mutable std::mutex mtx; // the accumulators, against the writer thread (stats= during the run)
    uint32_t every;
    uint64_t seen = 0; // ubatches with an output since the last reset

    // per shadowed ubatch (the sample): summed KL and its rows; summed NLL difference and its pairs
    std::vector<double>   kl_sum;
    std::vector<uint32_t> kl_n;
    std::vector<double>   dnll_sum;
    std::vector<uint32_t> dnll_n;
    double shadow_ns = 0.0;

    // the last output row of a shadowed ubatch, whose next token comes with the next ubatch
    bool                pending = false;
    size_t              pending_sample = 0;
    int32_t             pending_seq = -1;
    int32_t             pending_pos = -1;
    std::vector<float>  pending_exact;  // log-probabilities
    std::vector<float>  pending_served;

    std::vector<std::vector<uint8_t>> saved; // the state tensors' bytes before the exact pass
    std::vector<float> exact, served; // the two passes' logits, then log-probabilities, [n_outputs * n_vocab]
    std::vector<float> prob;          // one row of the exact pass's probabilities

    void resolve_pending(const llama_ubatch & ubatch);
    void compare(const llama_ubatch & ubatch, int64_t n_vocab, int64_t n_rows);
};
