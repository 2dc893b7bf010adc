#include "llama-expert-budget.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>

static std::string budget_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[2048];
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
        const std::string own = b.ram ? budget_format(", the reader buffers (%.1f MiB), the runtime's baseline "
            "(%.1f MiB)", b.readers/MiB, b.baseline/MiB) : std::string();
        err = budget_format("%s=%.0f MiB is too small: the weights %s (%.1f MiB), the "
            "context (%.1f MiB), the compute reserve (vram_reserve, %.1f MiB)%s and %d slots per layer (the experts "
            "used per token, %.1f MiB) need at least %.0f MiB", b.key(), b.budget/MiB,
            b.ram ? "in RAM, the experts excepted" : "on the device", b.weights/MiB, b.context/MiB, b.reserve/MiB,
            own.c_str(), b.k, (fixed - b.weights - b.context - b.reserve - b.readers - b.baseline +
            (uint64_t) b.k*b.per_slot)/MiB, std::ceil(minimum/MiB));
        return -1;
    }
    return (int32_t) std::min<uint64_t>((uint64_t) b.n_expert, (b.budget - fixed)/b.per_slot);
}

bool llama_expert_budget_check_usable(const llama_expert_budget & b, int32_t n_slots, uint64_t usable,
        const std::string & facts, std::string & err) {
    const double MiB = 1024.0*1024.0;
    if (b.total(n_slots) <= usable) {
        return true;
    }
    std::string fits;
    if (usable >= b.minimum()) {
        llama_expert_budget at = b;
        at.budget = usable / (1ull << 20) * (1ull << 20); // a whole number of MiB, as the user would write it
        std::string ignored;
        int32_t n = llama_expert_budget_slots(at, ignored);
        if (n < 0) {
            at.budget = usable;
            n = llama_expert_budget_slots(at, ignored);
        }
        fits = at.budget % (1ull << 20) == 0
            ? budget_format("%s=%lluM would fit (%d of %d experts resident per layer)", b.key(),
                (unsigned long long) (at.budget >> 20), n, b.n_expert)
            : budget_format("%s=%llu would fit (%d of %d experts resident per layer)", b.key(),
                (unsigned long long) at.budget, n, b.n_expert);
    } else {
        fits = budget_format("not even %d slots per layer fit (they need %.0f MiB): free memory, raise the limit, or "
            "lower vram_reserve or the context size", b.k, std::ceil(b.minimum()/MiB));
    }
    err = budget_format("%s=%.0f MiB is more than this process may use: the plan holds %.1f MiB (%d slots per layer) "
        "and %.1f MiB is usable (%s); %s", b.key(), b.budget/MiB, b.total(n_slots)/MiB, n_slots, usable/MiB,
        facts.c_str(), fits.c_str());
    return false;
}

std::string llama_expert_budget_plan_line(const llama_expert_budget & b, int32_t n_slots) {
    return budget_format("expert cache plan: %s=%llu weights=%llu context=%llu reserve=%llu readers=%llu baseline=%llu "
        "per_slot=%llu banks=%llu n_expert=%d k=%d slots=%d", b.key(), (unsigned long long) b.budget,
        (unsigned long long) b.weights, (unsigned long long) b.context, (unsigned long long) b.reserve,
        (unsigned long long) b.readers, (unsigned long long) b.baseline, (unsigned long long) b.per_slot,
        (unsigned long long) b.n_banks, b.n_expert, b.k, n_slots);
}

std::string llama_expert_budget_summary(const llama_expert_budget & b, int32_t n_slots) {
    const double MiB = 1024.0*1024.0;
    const std::string own = b.ram ? budget_format(" + readers %.1f MiB + runtime baseline %.1f MiB", b.readers/MiB,
        b.baseline/MiB) : std::string();
    return budget_format("%s budget %.1f MiB: weights %.1f MiB + context %.1f MiB + compute reserve %.1f MiB%s + cache "
        "banks %d slots x %.2f MiB (+1 spare) = %.1f MiB; %d of %d experts resident per layer (%.1f%%)",
        b.key(), b.budget/MiB, b.weights/MiB, b.context/MiB, b.reserve/MiB, own.c_str(), n_slots, b.per_slot/MiB,
        b.total(n_slots)/MiB, n_slots, b.n_expert, 100.0*n_slots/b.n_expert);
}
