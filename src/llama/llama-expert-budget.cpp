#include "llama-expert-budget.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>

static std::string budget_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

int32_t llama_expert_slots_for_residency(int32_t n_expert, double pct) {
    const int32_t n = (int32_t) std::lround((double) n_expert * pct / 100.0);
    return std::max<int32_t>(1, std::min(n, n_expert));
}

int32_t llama_expert_budget_slots(const llama_expert_budget & b, std::string & err) {
    const uint64_t fixed   = b.fixed();
    const uint64_t minimum = b.minimum();
    const double   MiB     = 1024.0*1024.0;
    if (b.per_slot == 0 || b.budget < minimum) {
        err = budget_format("%s=%.0f MiB is too small: the weights %s (%.1f MiB), the "
            "context (%.1f MiB), the compute reserve (vram_reserve, %.1f MiB) and %d slots per layer (the experts used "
            "per token, %.1f MiB) need at least %.0f MiB", b.key(), b.budget/MiB,
            b.ram ? "in RAM, the experts excepted" : "on the device", b.weights/MiB, b.context/MiB, b.reserve/MiB, b.k,
            (fixed - b.weights - b.context - b.reserve + (uint64_t) b.k*b.per_slot)/MiB, std::ceil(minimum/MiB));
        return -1;
    }
    return (int32_t) std::min<uint64_t>((uint64_t) b.n_expert, (b.budget - fixed)/b.per_slot);
}

std::string llama_expert_budget_plan_line(const llama_expert_budget & b, int32_t n_slots) {
    return budget_format("expert cache plan: %s=%llu weights=%llu context=%llu reserve=%llu per_slot=%llu banks=%llu "
        "n_expert=%d k=%d slots=%d", b.key(), (unsigned long long) b.budget, (unsigned long long) b.weights,
        (unsigned long long) b.context, (unsigned long long) b.reserve, (unsigned long long) b.per_slot,
        (unsigned long long) b.n_banks, b.n_expert, b.k, n_slots);
}

std::string llama_expert_budget_summary(const llama_expert_budget & b, int32_t n_slots) {
    const double MiB = 1024.0*1024.0;
    return budget_format("%s budget %.1f MiB: weights %.1f MiB + context %.1f MiB + compute reserve %.1f MiB + cache "
        "banks %d slots x %.2f MiB (+1 spare) = %.1f MiB; %d of %d experts resident per layer (%.1f%%)",
        b.key(), b.budget/MiB, b.weights/MiB, b.context/MiB, b.reserve/MiB, n_slots, b.per_slot/MiB,
        (b.fixed() + (uint64_t) n_slots*b.per_slot)/MiB, n_slots, b.n_expert, 100.0*n_slots/b.n_expert);
}
