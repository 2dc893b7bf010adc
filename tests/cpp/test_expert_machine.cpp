// Unit tests of the machine's memory facts (src/llama/llama-expert-machine.cpp) and of a budget checked against them
// (llama_expert_budget_check_usable), on fake /proc and /sys contents.
// Built and run by tests/test_machine.py: c++ -std=c++17 -O1 -Isrc/llama -Isrc/include this.cpp with the model-free
// sources (MOE_SUBST_POLICY_SOURCES in src/moe-subst.cmake)
#include "llama-expert-budget.h"
#include "llama-expert-machine.h"

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

static int n_fail = 0;

#define CHECK(cond) do { if (!(cond)) { std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); ++n_fail; } } while (0)

static const uint64_t MiB = 1ull << 20;

// a fake file system: path -> contents
static llama_expert_machine machine_of(const std::map<std::string, std::string> & files) {
    return llama_expert_machine_read([&files](const std::string & path, std::string & contents) {
        const auto it = files.find(path);
        if (it == files.end()) {
            return false;
        }
        contents = it->second;
        return true;
    });
}

static const char * MEMINFO =
    "MemTotal:       24730624 kB\n"
    "MemFree:        14135296 kB\n"
    "MemAvailable:   19914752 kB\n"
    "Buffers:          123456 kB\n";

static void test_parsers() {
    uint64_t total = 0, avail = 0;
    CHECK(llama_expert_machine_parse_meminfo(MEMINFO, total, avail));
    CHECK(total == 24730624ull*1024 && avail == 19914752ull*1024);
    CHECK(!llama_expert_machine_parse_meminfo("MemTotal: 1 kB\nMemFree: 1 kB\n", total, avail)); // an old kernel
    CHECK(!llama_expert_machine_parse_meminfo("", total, avail));

    CHECK(llama_expert_machine_parse_rss_anon("Name:\tx\nRssAnon:\t    5120 kB\nRssFile: 1 kB\n") == 5*MiB);
    CHECK(llama_expert_machine_parse_rss_anon("Name:\tx\n") == 0);

    int v = 0;
    std::string path;
    CHECK(llama_expert_machine_parse_cgroup("0::/user.slice/user-0.slice/session-1.scope\n", v, path));
    CHECK(v == 2 && path == "/user.slice/user-0.slice/session-1.scope");
    // v1: the memory controller's line, alone or with others; a v2 line beside it (hybrid) does not win
    CHECK(llama_expert_machine_parse_cgroup("12:pids:/a\n4:memory:/docker/abc\n1:name=systemd:/b\n0::/c\n", v, path));
    CHECK(v == 1 && path == "/docker/abc");
    CHECK(llama_expert_machine_parse_cgroup("3:cpu,memory,cpuacct:/x/y\n", v, path) && v == 1 && path == "/x/y");
    CHECK(llama_expert_machine_parse_cgroup("0::/\n", v, path) && v == 2 && path == "/");
    CHECK(!llama_expert_machine_parse_cgroup("12:pids:/a\n1:name=systemd:/b\n", v, path)); // no memory controller
    CHECK(!llama_expert_machine_parse_cgroup("0::/../../other\n", v, path));              // outside our namespace
    CHECK(!llama_expert_machine_parse_cgroup("", v, path));
    CHECK(!llama_expert_machine_parse_cgroup("garbage\n", v, path));

    uint64_t limit = 1;
    CHECK(llama_expert_machine_parse_limit("max\n", limit) && limit == 0);
    CHECK(llama_expert_machine_parse_limit("157286400\n", limit) && limit == 150*MiB);
    CHECK(llama_expert_machine_parse_limit("9223372036854771712\n", limit) && limit == 0); // v1 "unlimited"
    CHECK(!llama_expert_machine_parse_limit("", limit));
    CHECK(!llama_expert_machine_parse_limit("-1\n", limit));
    CHECK(!llama_expert_machine_parse_limit("99999999999999999999999\n", limit)); // overflow

    const char * stat = "anon 1048576\nfile 2097152\nkernel 4096\n";
    CHECK(llama_expert_machine_parse_stat(stat, "file") == 2*MiB);
    CHECK(llama_expert_machine_parse_stat(stat, "anon") == MiB);
    CHECK(llama_expert_machine_parse_stat(stat, "fil") == 0);
    CHECK(llama_expert_machine_parse_stat("cache 10\ntotal_cache 20\n", "total_cache") == 20);
}

static void test_read() {
    // no files at all: nothing known, everything usable
    llama_expert_machine m = machine_of({});
    CHECK(m.mem_available == 0 && m.cgroup_version == 0 && m.usable() == UINT64_MAX);
    CHECK(m.describe().find("no memory facts") == 0);

    // MemAvailable only (no cgroup file): what is available plus what this process holds already
    m = machine_of({{"/proc/meminfo", MEMINFO}, {"/proc/self/status", "RssAnon:\t10240 kB\n"}});
    CHECK(m.usable() == 19914752ull*1024 + 10*MiB);

    // v2, nested: the limit of a parent binds when it is tighter than our own cgroup's ("max" at our level)
    std::map<std::string, std::string> v2 = {
        {"/proc/meminfo", MEMINFO},
        {"/proc/self/status", "RssAnon:\t4096 kB\n"},
        {"/proc/self/cgroup", "0::/a/b/c\n"},
        {"/sys/fs/cgroup/a/b/c/memory.max", "max\n"},
        {"/sys/fs/cgroup/a/b/c/memory.current", "10485760\n"},
        {"/sys/fs/cgroup/a/b/memory.max", "157286400\n"},
        {"/sys/fs/cgroup/a/b/memory.current", "20971520\n"},           // 20 MiB charged, 4 MiB of it page cache
        {"/sys/fs/cgroup/a/b/memory.stat", "anon 16777216\nfile 4194304\n"},
        {"/sys/fs/cgroup/a/memory.max", "1073741824\n"},
        {"/sys/fs/cgroup/a/memory.current", "104857600\n"},
    };
    m = machine_of(v2);
    CHECK(m.cgroup_version == 2 && m.cgroup == "/a/b" && m.cgroup_limit == 150*MiB);
    CHECK(m.cgroup_charged == 16*MiB);
    // 150 MiB less the 12 MiB that others hold (16 charged, 4 of them ours)
    CHECK(m.usable() == 138*MiB);
    CHECK(m.describe().find("the memory cgroup /a/b (v2, limit 150.0 MiB, 12.0 MiB used by others)") == 0);
    CHECK(m.describe().find("MemAvailable") != std::string::npos);
    // our own cgroup tighter than its parents
    v2["/sys/fs/cgroup/a/b/c/memory.max"] = "67108864\n";
    m = machine_of(v2);
    CHECK(m.cgroup == "/a/b/c" && m.cgroup_limit == 64*MiB && m.usable() == 64*MiB - 6*MiB);
    // a parent whose headroom (not its limit) is tighter: 1 GiB with 1000 MiB in use by others
    v2["/sys/fs/cgroup/a/memory.current"] = std::to_string(1000*MiB + 4*MiB) + "\n";
    m = machine_of(v2);
    CHECK(m.cgroup == "/a" && m.usable() == 24*MiB);
    // MemAvailable tighter than every cgroup
    v2["/proc/meminfo"] = "MemTotal: 1048576 kB\nMemAvailable: 8192 kB\n";
    m = machine_of(v2);
    CHECK(m.usable() == 12*MiB); // 8 MiB available + the 4 MiB we hold

    // in a cgroup namespace: "0::/", our cgroup's files at the root of /sys/fs/cgroup
    m = machine_of({{"/proc/self/cgroup", "0::/\n"}, {"/sys/fs/cgroup/memory.max", "209715200\n"},
                    {"/sys/fs/cgroup/memory.current", "0\n"}});
    CHECK(m.cgroup == "/" && m.cgroup_limit == 200*MiB && m.usable() == 200*MiB);
    // the host's root cgroup: no memory.max anywhere
    m = machine_of({{"/proc/self/cgroup", "0::/init.scope\n"}, {"/proc/meminfo", MEMINFO}});
    CHECK(m.cgroup_version == 2 && m.cgroup_limit == 0 && m.usable() == 19914752ull*1024);

    // v1: memory.limit_in_bytes, usage less total_cache; the "unlimited" value is no limit
    std::map<std::string, std::string> v1 = {
        {"/proc/self/cgroup", "5:memory:/docker/abc\n0::/\n"},
        {"/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", "536870912\n"},
        {"/sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "115343360\n"},
        {"/sys/fs/cgroup/memory/docker/abc/memory.stat", "cache 1\ntotal_cache 104857600\n"},
        {"/sys/fs/cgroup/memory/docker/memory.limit_in_bytes", "9223372036854771712\n"},
        {"/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"},
    };
    m = machine_of(v1);
    CHECK(m.cgroup_version == 1 && m.cgroup == "/docker/abc" && m.cgroup_limit == 512*MiB);
    CHECK(m.cgroup_charged == 10*MiB && m.usable() == 502*MiB);
    CHECK(m.describe().find("(v1, limit 512.0 MiB") != std::string::npos);
    // a damaged limit file is no limit, not a crash
    v1["/sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes"] = "garbage";
    m = machine_of(v1);
    CHECK(m.cgroup_limit == 0 && m.usable() == UINT64_MAX);
}

static void test_check_usable() {
    llama_expert_budget b;
    b.ram      = true;
    b.budget   = 16384*MiB;
    b.weights  = 8*MiB;
    b.context  = 1*MiB;
    b.reserve  = 16*MiB;
    b.readers  = 5*MiB;
    b.baseline = LLAMA_EXPERT_RUNTIME_BASELINE;
    b.per_slot = 4*MiB;
    b.n_banks  = 12;
    b.n_expert = 64;
    b.k        = 4;
    std::string err;
    const int32_t n = llama_expert_budget_slots(b, err);
    CHECK(n == 64);
    // everything resident holds 8+1+16+5+48 + 65*4 MiB + 6 KiB: above a 150 MiB cgroup
    CHECK(!llama_expert_budget_check_usable(b, n, 150*MiB, "the memory cgroup /t", err));
    CHECK(err.find("ram=16384 MiB is more than this process may use") == 0);
    CHECK(err.find("(the memory cgroup /t)") != std::string::npos);
    CHECK(err.find("ram=150M would fit (16 of 64 experts resident per layer)") != std::string::npos); // (150-82)/4 = 16.99
    CHECK(err.find('\n') == std::string::npos);
    // a budget above what is usable whose plan holds less passes: every expert is resident already
    CHECK(llama_expert_budget_check_usable(b, n, 400*MiB, "x", err));
    // not even k slots
    CHECK(!llama_expert_budget_check_usable(b, n, 90*MiB, "x", err));
    CHECK(err.find("not even 4 slots per layer fit (they need 99 MiB)") != std::string::npos);
    // the plan line carries the new terms
    CHECK(llama_expert_budget_plan_line(b, 16).find(" reserve=16777216 readers=5242880 baseline=50331648 per_slot=") !=
          std::string::npos);
}

int main() {
    test_parsers();
    test_read();
    test_check_usable();
    if (n_fail) {
        std::fprintf(stderr, "%d checks failed\n", n_fail);
        return 1;
    }
    std::printf("all expert machine tests passed\n");
    return 0;
}
