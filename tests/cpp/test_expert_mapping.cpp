// Unit tests of the mapping's confinement (src/llama/llama-expert-mapping.cpp): which ranges of a model file are
// marked random-access, and that a real mapping's non-expert ranges carry VM_RAND_READ ("rr" in /proc/self/smaps)
// and its expert ranges do not.
// Built and run by tests/test_mapping.py: c++ -std=c++17 -O1 -Isrc/llama this.cpp src/llama/llama-expert-mapping.cpp
#include "llama-expert-mapping.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

static int n_fail = 0;

#define CHECK(cond) do { if (!(cond)) { std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); ++n_fail; } } while (0)

using ranges = std::vector<std::pair<uint64_t, uint64_t>>;

static void test_gaps() {
    const uint64_t P = 4096;
    // two expert ranges, page-aligned, a header before, a gap between, a tail after
    CHECK((llama_expert_mapping_gaps(10*P, {{2*P, 3*P}, {6*P, 2*P}}, P) == ranges{{0, 2*P}, {5*P, 6*P}, {8*P, 10*P}}));
    // unsorted input gives the same
    CHECK((llama_expert_mapping_gaps(10*P, {{6*P, 2*P}, {2*P, 3*P}}, P) == ranges{{0, 2*P}, {5*P, 6*P}, {8*P, 10*P}}));
    // partial pages at an expert range's ends are non-expert (they hold other tensors' bytes too)
    CHECK((llama_expert_mapping_gaps(10*P, {{2*P + 100, 3*P}, }, P) == ranges{{0, 3*P}, {5*P, 10*P}}));
    // adjacent expert ranges leave no gap between them; a file ending inside a page is rounded up to the page
    CHECK((llama_expert_mapping_gaps(6*P + 10, {{P, 2*P}, {3*P, 2*P}}, P) == ranges{{0, P}, {5*P, 7*P}}));
    // an expert range smaller than a page has no whole page: all non-expert
    CHECK((llama_expert_mapping_gaps(4*P, {{P + 8, 100}}, P) == ranges{{0, 4*P}}));
    // experts cover the file: nothing to mark
    CHECK(llama_expert_mapping_gaps(4*P, {{0, 4*P}}, P).empty());
    // no experts: the whole file
    CHECK((llama_expert_mapping_gaps(4*P, {}, P) == ranges{{0, 4*P}}));
}

// the VmFlags of the smaps entry that starts at `addr`, "" when none does
static std::string vm_flags_at(uintptr_t addr) {
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool in = false;
    while (std::getline(smaps, line)) {
        unsigned long long lo = 0, hi = 0;
        if (std::sscanf(line.c_str(), "%llx-%llx ", &lo, &hi) == 2 && line.find(':') > line.find('-')) {
            in = (uintptr_t) lo == addr;
            continue;
        }
        if (in && line.rfind("VmFlags:", 0) == 0) {
            return line;
        }
    }
    return "";
}

static bool rand_read(uintptr_t addr) {
    const std::string f = vm_flags_at(addr);
    return f.find(" rr") != std::string::npos;
}

static void test_real_mapping() {
    const uint64_t P = (uint64_t) sysconf(_SC_PAGESIZE);
    char path[] = "/tmp/moe-subst-mapping-XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) {
        return;
    }
    unlink(path);
    const uint64_t size = 16*P;
    CHECK(ftruncate(fd, (off_t) size) == 0);
    void * p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    CHECK(p != MAP_FAILED);
    if (p == MAP_FAILED) {
        close(fd);
        return;
    }
    const uintptr_t base = (uintptr_t) p;
    CHECK(!rand_read(base)); // a fresh mapping: default read-around
    const auto c = llama_expert_mapping_confine(base, size, {{4*P, 6*P}, {12*P, 2*P}});
    CHECK(c.ranges == 3 && c.failed == 0);
    CHECK(c.bytes == (4 + 2 + 2)*P);
    // the mapping is split where the flags differ: non-expert ranges random, expert ranges not
    CHECK(rand_read(base));
    CHECK(!rand_read(base + 4*P));
    CHECK(rand_read(base + 10*P));
    CHECK(!rand_read(base + 12*P));
    CHECK(rand_read(base + 14*P));
    // a range with a hole (llama.cpp unmaps the parts of the file no tensor uses): the mapped rest is marked
    munmap((void *) (base + 14*P), P);
    const auto holed = llama_expert_mapping_confine(base, size, {{4*P, 6*P}, {12*P, 2*P}});
    CHECK(holed.ranges == 3 && holed.failed == 0);
    CHECK(rand_read(base + 15*P));
    // an address inside a page is refused, nothing marked
    const auto bad = llama_expert_mapping_confine(base + 1, size, {});
    CHECK(bad.ranges == 0 && bad.failed == 1);
    munmap(p, 14*P);
    munmap((void *) (base + 15*P), P);
    close(fd);
}

int main() {
    test_gaps();
    test_real_mapping();
    if (n_fail) {
        std::fprintf(stderr, "%d check(s) failed\n", n_fail);
        return 1;
    }
    std::printf("all expert mapping tests passed\n");
    return 0;
}
