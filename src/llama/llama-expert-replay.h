#pragma once

// Routing replay (tests and benchmarks only: LLAMA_MOE_CACHE_TEST_REPLAY=<router trace>). The route step takes each
// token's selected experts and their gate weights from a router trace recorded with `trace=` on another model with
// the same experts per layer and k, instead of the model's own router, so that a generated (random-weight) model of
// a real geometry is timed under a trained model's routing (issue 23, item 6). The model's outputs are then not its
// own: a run with replay measures speed and hit rates, never quality. Model-free: it reads the trace file only.
//
// Layer mapping: the model's j-th MoE layer replays the trace's (j mod L)-th MoE layer, L the trace's MoE layers.
// Model layers that share a trace layer start at different points of its records (evenly spaced), so that they do
// not route identically; each layer's cursor wraps at the end of its records and is not reset by a cache reset
// (llama-bench's repetitions then see distinct routing).

#include <cstdint>
#include <string>
#include <vector>

#define LLAMA_EXPERT_REPLAY_ENV "LLAMA_MOE_CACHE_TEST_REPLAY"

struct llama_expert_replay {
    int32_t k = 0;
    int32_t n_expert = 0;
    std::string path;

    // per trace MoE layer (in the trace's layer order): its records' ids and weights, k per record
    std::vector<std::vector<int32_t>> ids;
    std::vector<std::vector<float>>   weights;
    std::vector<uint32_t>             trace_layer; // the trace's layer number of each entry above

    // per model layer: the entry it replays (-1: not an MoE layer) and its cursor (a record index)
    std::vector<int32_t>  layer_src;
    std::vector<uint64_t> cursor;

    // read `path` and map the model's MoE layers (moe[il] true) onto the trace's; false with a one-line reason in err
    // (not a trace, a truncated one, another n_expert or k, no records)
    bool load(const std::string & path, int32_t n_expert, int32_t k, const std::vector<bool> & moe, std::string & err);

    // the next record of model layer il: k expert ids and their gate weights
    void next(int32_t il, int32_t * out_ids, float * out_w);

    // one line for the log: what is replayed onto what
    std::string describe() const;
};
