#pragma once

// Residency and budget arithmetic (moe-subst): how many experts per layer a residency or a memory budget gives.
// Numbers in, numbers out: no model, no ggml, so that it is unit tested alone (tests/cpp/test_expert_budget.cpp).
// The engine measures the model (llama_expert_engine_slots_for_budget) and asks this room; the harness reads the
// plan line it logs.

#include <cstdint>
#include <string>

// The slots of a residency given as a percentage of a layer's n_expert experts: rounded to the nearest (halves away
// from zero, as std::lround), at least 1, at most n_expert. The harness's slots_for_residency rounds the same way.
int32_t llama_expert_slots_for_residency(int32_t n_expert, double pct);

// One residency budget (vram= or ram=): what the banks must share the memory with, and what one slot costs.
struct llama_expert_budget {
    bool     ram      = false; // ram= (the process's RAM, experts read from the file) or vram= (the banks' devices)
    uint64_t budget   = 0;     // the bytes given
    uint64_t weights  = 0;     // the model's weights in the budget's memory (ram=: all but the routed experts)
    uint64_t context  = 0;     // the context's memory (KV cache) there
    uint64_t reserve  = 0;     // vram_reserve: left for the compute buffers
    uint64_t readers  = 0;     // ram= with host=file: the reader threads' buffers (each one expert slice, aligned)
    uint64_t baseline = 0;     // ram=: the runtime's own memory (LLAMA_EXPERT_RUNTIME_BASELINE)
    uint64_t per_slot = 0;     // bytes of one slot in every bank of every MoE layer
    uint64_t n_banks  = 0;     // banks of all MoE layers (each has a spare slot and alignment padding)
    int32_t  n_expert = 0;
    int32_t  k        = 0;     // experts used per token: the fewest slots that work

    const char * key() const { return ram ? "ram" : "vram"; }
    // the bytes that do not depend on the slots: weights, context, reserve, reader buffers, the runtime's baseline,
    // the spare slots and padding
    uint64_t fixed() const { return weights + context + reserve + readers + baseline + per_slot + 512*n_banks; }
    // the smallest budget that fits k slots
    uint64_t minimum() const { return fixed() + (uint64_t) k*per_slot; }
    // the bytes the plan holds with n_slots per layer
    uint64_t total(int32_t n_slots) const { return fixed() + (uint64_t) n_slots*per_slot; }
};

// The slots per layer that fit (at most n_expert); -1 with err set (one line, naming the minimum) when fewer than k
// fit or nothing is banked.
int32_t llama_expert_budget_slots(const llama_expert_budget & b, std::string & err);

// A plan checked against what the process may really hold (`usable` bytes: llama_expert_machine::usable, described by
// `facts`): false with err set (one line: the budget, what is usable and where that comes from, and the budget that
// would fit with its slots, or that not even k slots fit) when the plan's total is more than that. A budget above
// `usable` whose plan holds less (every expert resident already) passes.
bool llama_expert_budget_check_usable(const llama_expert_budget & b, int32_t n_slots, uint64_t usable,
        const std::string & facts, std::string & err);

// The plan line the engine logs, in exact bytes ("expert cache plan: vram=... slots=N"; harness/parsers reads it).
std::string llama_expert_budget_plan_line(const llama_expert_budget & b, int32_t n_slots);

// The same plan in MiB, for people.
std::string llama_expert_budget_summary(const llama_expert_budget & b, int32_t n_slots);
