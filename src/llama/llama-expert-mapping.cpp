#include "llama-expert-mapping.h"

#include <algorithm>
#include <cerrno>

#include <sys/mman.h>
#include <unistd.h>

std::vector<std::pair<uint64_t, uint64_t>> llama_expert_mapping_gaps(
        uint64_t size, std::vector<std::pair<uint64_t, uint64_t>> experts, uint64_t page) {
    std::sort(experts.begin(), experts.end());
    std::vector<std::pair<uint64_t, uint64_t>> gaps;
    uint64_t at = 0; // the next file offset not yet covered, page-aligned
    for (const auto & [off, n] : experts) {
        // an expert range's inner whole pages are expert; its partial first and last pages are not
        const uint64_t lo = (off + page - 1) / page * page;
        const uint64_t hi = std::min(size, off + n) / page * page;
        if (hi <= lo) {
            continue;
        }
        if (lo > at) {
            gaps.emplace_back(at, lo);
        }
        at = std::max(at, hi);
    }
    const uint64_t end = (size + page - 1) / page * page;
    if (end > at) {
        gaps.emplace_back(at, end);
    }
    return gaps;
}

llama_expert_mapping_confined llama_expert_mapping_confine(
        uintptr_t base, uint64_t size, std::vector<std::pair<uint64_t, uint64_t>> experts) {
    llama_expert_mapping_confined r;
    const uint64_t page = (uint64_t) sysconf(_SC_PAGESIZE);
    if (base % page != 0) {
        r.failed = 1; // not the start of a mapping: nothing to mark
        return r;
    }
    for (const auto & [lo, hi] : llama_expert_mapping_gaps(size, std::move(experts), page)) {
        void * p = (void *) (base + lo);
        // ENOMEM: the range has holes (llama.cpp unmaps the parts of the file no tensor uses, the header first); the
        // advice is applied to what is mapped
        if (madvise(p, hi - lo, MADV_RANDOM) != 0 && errno != ENOMEM) {
            ++r.failed;
            continue;
        }
        madvise(p, hi - lo, MADV_WILLNEED); // a hint: its failure changes nothing
        r.bytes += hi - lo;
        ++r.ranges;
    }
    return r;
}
