// Unit tests of the measurement near the fit (src/llama/llama-expert-resident.cpp): the ranges merged into whole
// pages, touched and counted once; with a file argument, the whole file mapped and measured beside a ballast, one
// line printed ("touched T resident R ballast B", bytes), which tests/test_resident.py runs inside a memory cgroup.
// Built by tests/test_resident.py: c++ -std=c++17 -O1 -Isrc/llama this.cpp src/llama/llama-expert-resident.cpp
#include "llama-expert-resident.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int n_fail = 0;

#define CHECK(cond) do { if (!(cond)) { std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); ++n_fail; } } while (0)

static int measure_file(const char * path, uint64_t ballast) {
    const int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        std::fprintf(stderr, "cannot open %s\n", path);
        return 2;
    }
    void * base = mmap(nullptr, (size_t) st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        std::fprintf(stderr, "cannot map %s\n", path);
        return 2;
    }
    const uintptr_t b = (uintptr_t) base;
    // two overlapping halves: the middle counted once
    const auto r = llama_expert_touch_resident({{b, b + (uintptr_t) st.st_size*2/3}, {b + (uintptr_t) st.st_size/3,
        b + (uintptr_t) st.st_size}}, ballast);
    std::printf("touched %llu resident %llu ballast %llu ok %d\n", (unsigned long long) r.touched,
        (unsigned long long) r.resident, (unsigned long long) r.ballast, r.ok ? 1 : 0);
    return 0;
}

static void test_in_memory() {
    const long page = sysconf(_SC_PAGESIZE);
    // anonymous memory, touched: every page resident; a range inside a page widens to the page
    const size_t n = 64*(size_t) page;
    char * p = (char *) mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    const uintptr_t b = (uintptr_t) p;
    auto r = llama_expert_touch_resident({{b + 10, b + 20}}, 0);
    CHECK(r.ok && r.touched == (uint64_t) page && r.resident == (uint64_t) page && r.all());
    // overlapping and unsorted ranges: merged, each page once
    r = llama_expert_touch_resident({{b + 32*page, b + 64*page}, {b, b + 40*page}, {b + 8*page, b + 9*page}}, 0);
    CHECK(r.touched == n && r.resident == n && r.all());
    // pages dropped after the touch would not be resident: mincore sees what is there (the count is not the touch's)
    madvise(p, n, MADV_DONTNEED);
    unsigned char v = 1;
    CHECK(mincore(p, (size_t) page, &v) == 0 && (v & 1) == 0);
    // the ballast is touched and reported
    r = llama_expert_touch_resident({{b, b + n}}, 3*(uint64_t) page);
    CHECK(r.ballast == 3*(uint64_t) page && r.all());
    // nothing to touch: not all() (no evidence that anything stays)
    r = llama_expert_touch_resident({}, 0);
    CHECK(r.touched == 0 && !r.all());
    r = llama_expert_touch_resident({{b + 5*page, b + 5*page}}, 0);
    CHECK(r.touched == 0 && !r.all());
    munmap(p, n);
}

int main(int argc, char ** argv) {
    if (argc == 3) {
        return measure_file(argv[1], std::strtoull(argv[2], nullptr, 10));
    }
    test_in_memory();
    if (n_fail == 0) {
        std::printf("all expert resident tests passed\n");
    }
    return n_fail == 0 ? 0 : 1;
}
