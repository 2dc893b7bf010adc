#include "llama-expert-resident.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

llama_expert_resident llama_expert_touch_resident(std::vector<std::pair<uintptr_t, uintptr_t>> ranges,
        uint64_t ballast) {
    llama_expert_resident r;
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    // whole pages, merged: a page shared by two tensors is touched and counted once
    for (auto & rg : ranges) {
        rg.first &= ~(page - 1);
        rg.second = (rg.second + page - 1) & ~(page - 1);
    }
    std::sort(ranges.begin(), ranges.end());
    std::vector<std::pair<uintptr_t, uintptr_t>> merged;
    for (const auto & rg : ranges) {
        if (rg.second <= rg.first) {
            continue;
        }
        if (!merged.empty() && rg.first <= merged.back().second) {
            merged.back().second = std::max(merged.back().second, rg.second);
        } else {
            merged.push_back(rg);
        }
    }
    // the ballast first, so that the weights' pages compete with it as with the buffers of a decode
    char * held = nullptr;
    if (ballast > 0) {
        held = (char *) malloc(ballast);
        if (held != nullptr) {
            memset(held, 1, ballast);
            r.ballast = ballast;
        }
    }
    volatile unsigned char sink = 0;
    for (const auto & rg : merged) {
        for (uintptr_t p = rg.first; p < rg.second; p += page) {
            sink = sink + *(const volatile unsigned char *) p;
        }
        r.touched += rg.second - rg.first;
    }
    (void) sink;
    r.ok = true;
    std::vector<unsigned char> vec;
    for (const auto & rg : merged) {
        const size_t n = (rg.second - rg.first) / page;
        vec.assign(n, 0);
        if (mincore((void *) rg.first, rg.second - rg.first, vec.data()) != 0) {
            r.ok = false;
            continue;
        }
        for (size_t i = 0; i < n; ++i) {
            r.resident += (vec[i] & 1) ? page : 0;
        }
    }
    free(held);
    return r;
}
