#pragma once

// What a loaded model holds for the expert cache (moe-subst): where each layer lives, which of its tensors are routed
// experts and how one expert is sliced out of them; from these, the residency a budget allows (`vram=`, `ram=`) and
// the facts `--moe-cache auto` decides on. The engine (llama-expert-engine.h) banks the same tensors; the budget's
// arithmetic is llama-expert-budget.h's, the decision llama-expert-auto.h's: this room only measures.

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-expert-auto.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

struct llama_model;
struct llama_layer;

// the device of a layer (the output device for layers the model did not place, if any)
ggml_backend_dev_t llama_expert_layer_dev(const llama_model & model, int il);

// a device reached over the network (ggml-rpc's devices, `--rpc`); its name and description ("RPC0 (127.0.0.1:50052)")
// for messages, "" for a local device
std::string llama_expert_remote_dev(ggml_backend_dev_t dev);

// the dimension of an expert tensor that indexes experts: its highest dimension with more than one element
int llama_expert_dim(const ggml_tensor * t);

// the routed-expert tensors of a layer that the engine banks (gate, up, down or merged gate_up, their biases `_b` and
// scales `_s`), null where the layer has none: the one list of them, for the banks and the budget
constexpr size_t LLAMA_EXPERT_N_TENSORS = 11;
std::array<ggml_tensor *, LLAMA_EXPERT_N_TENSORS> llama_expert_layer_tensors(const llama_layer & ml);

// Residency by budget (`vram=SIZE`): the slots per layer that fit in `budget` bytes next to the model's weights
// and the context's memory (ctx_mem) in the buffer types of the MoE layers, plus `reserve` bytes for the
// compute buffers; at most n_expert. Logs the plan. Throws, naming the minimum budget, when fewer than k fit.
// ram (`ram=SIZE`, CPU builds with host=file): the budget is the process's RAM: all weights but the routed
// experts, and all of the context's memory, whatever their buffer types, the reader threads' buffers (`readers`
// threads with host=file) and the runtime's baseline (runtime: auto's, from what the process holds; 0:
// LLAMA_EXPERT_RUNTIME_BASELINE). engine: a plan (ram=, or vram= on host memory) above what the
// process may hold (llama-expert-machine.h: memory cgroup, MemAvailable) throws, saying what would fit.
int32_t llama_expert_engine_slots_for_budget(const llama_model & model, const std::vector<bool> & moe,
        int32_t n_expert, int32_t k, uint64_t budget, uint64_t reserve,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem, const std::string & prefix, bool ram = false,
        int32_t readers = 0, bool engine = false, uint64_t runtime = 0);

// `--moe-cache auto`: the model's facts for llama_expert_auto_decide (llama-expert-auto.h): its sizes (weights, routed
// experts, one slot, the banks), the context's memory (ctx_mem), where the experts are (host memory or a GPU, with the
// GPU's free memory), whether they are mapped from the model file and whether the CPU repacked them.
llama_expert_auto_model llama_expert_engine_auto_facts(const llama_model & model,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem);

// The host memory of the model's weights mapped from its file(s): [begin, end) addresses of every tensor whose data
// is in a mapping (near the fit, auto touches them to measure whether stock's weights stay resident)
std::vector<std::pair<uintptr_t, uintptr_t>> llama_expert_mapped_weight_ranges(const llama_model & model);
