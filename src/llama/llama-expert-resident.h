#pragma once

// Whether stock's weights stay in memory here, measured (moe-subst, issue 35). Where auto's estimate of what stock
// holds is within the compute buffers and logits of what the process may use (the band: stock's weights fit beside
// what the process holds, and the estimate's buffers, sized for a whole ubatch and a whole batch's logits, may not be
// touched by the tool), the estimate cannot say whether stock decodes at full speed or thrashes its page cache
// (studymoe in 92 MiB: stock 776 t/s where the estimate said no; in 88 MiB: 26 t/s). This asks the machine: every
// page of the mapped weights is touched once, as stock's first tokens would, beside a touched anonymous ballast for
// what a decode adds, and the pages still resident afterwards (mincore) are counted. In a memory cgroup or a small
// machine, a working set above the limit evicts its own earlier pages while it is touched: fewer are resident.

#include <cstdint>
#include <utility>
#include <vector>

struct llama_expert_resident {
    uint64_t touched  = 0;  // bytes of the ranges touched (whole pages)
    uint64_t resident = 0;  // of those, resident after every page was touched
    uint64_t ballast  = 0;  // anonymous bytes touched and held while they were
    bool     ok       = false; // mincore answered for every range

    // every touched page stayed resident
    bool all() const { return ok && touched > 0 && resident == touched; }
};

// ranges: [begin, end) addresses of mapped memory (merged and widened to whole pages here); ballast: bytes of
// anonymous memory touched before the ranges and freed after the count.
llama_expert_resident llama_expert_touch_resident(std::vector<std::pair<uintptr_t, uintptr_t>> ranges,
        uint64_t ballast);
