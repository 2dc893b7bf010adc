#pragma once

// host=file: the model's mapping around the experts (moe-subst). The banks read missed experts from the file; the
// non-expert weights (attention, norms, router, embeddings) stay in the mapping, in the page cache. A page fault in a
// mapping reads ahead around the page (read_ahead_kb of the device, doubled by llama.cpp's POSIX_FADV_SEQUENTIAL):
// a fault on a layer's attention weights reads megabytes of the expert tensors beside them, which nobody maps, and
// under a memory limit (a cgroup, a small machine) those pages evict the weights the next token needs, which fault
// again: on the 48-layer, 41 GiB model in 8 GiB at read_ahead_kb 8192, fetch-all read 2.3 GB per token through the
// mapping for 6 MB of experts (eval/bench-tiers-full-thrash). llama_expert_mapping_confine marks the non-expert
// ranges MADV_RANDOM (a fault there reads its own page, nothing around it) and asks for them once
// (MADV_WILLNEED: read ahead within those ranges only). The expert ranges keep the default read-around, for the
// ubatches that take the stock path (prefill) and fault them in.

#include <cstdint>
#include <utility>
#include <vector>

struct llama_expert_mapping_confined {
    uint64_t bytes  = 0; // non-expert bytes marked random-access
    int      ranges = 0; // their ranges (madvise calls that succeeded)
    int      failed = 0; // ranges madvise refused (left as they were)
};

// A file mapped whole at `base` (file offset 0), `size` bytes; `experts`: the byte ranges [off, off + n) of the file
// that hold expert tensors. The complement, widened to whole pages (a page shared with an expert tensor counts as
// non-expert), is marked; nothing is marked for an empty complement.
llama_expert_mapping_confined llama_expert_mapping_confine(
        uintptr_t base, uint64_t size, std::vector<std::pair<uint64_t, uint64_t>> experts);

// The non-expert ranges of the complement, page-aligned (for the tests and the log): [begin, end) file offsets.
std::vector<std::pair<uint64_t, uint64_t>> llama_expert_mapping_gaps(
        uint64_t size, std::vector<std::pair<uint64_t, uint64_t>> experts, uint64_t page);
