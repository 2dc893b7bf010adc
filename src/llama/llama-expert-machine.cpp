#include "llama-expert-machine.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

static std::string machine_mib(uint64_t bytes) {
    char buf[64];
    if (bytes >= (10ull << 30)) {
        snprintf(buf, sizeof(buf), "%.1f GiB", bytes/(1024.0*1024.0*1024.0));
    } else {
        snprintf(buf, sizeof(buf), "%.1f MiB", bytes/(1024.0*1024.0));
    }
    return buf;
}

static bool machine_parse_u64(const std::string & s, uint64_t & out) {
    size_t b = 0;
    size_t e = s.size();
    while (b < e && (s[b] == ' ' || s[b] == '\t')) {
        b++;
    }
    while (e > b && (s[e-1] == ' ' || s[e-1] == '\t' || s[e-1] == '\n' || s[e-1] == '\r')) {
        e--;
    }
    if (b == e || e - b > 20) {
        return false;
    }
    uint64_t v = 0;
    for (size_t i = b; i < e; ++i) {
        if (s[i] < '0' || s[i] > '9') {
            return false;
        }
        const uint64_t d = (uint64_t) (s[i] - '0');
        if (v > (UINT64_MAX - d)/10) {
            return false;
        }
        v = v*10 + d;
    }
    out = v;
    return true;
}

// "Key:   123 kB" lines (/proc/meminfo, /proc/self/status): the value in bytes
static bool machine_kb_field(const std::string & text, const char * key, uint64_t & bytes) {
    std::istringstream in(text);
    std::string line;
    const std::string want = std::string(key) + ":";
    while (std::getline(in, line)) {
        if (line.compare(0, want.size(), want) != 0) {
            continue;
        }
        std::istringstream fields(line.substr(want.size()));
        std::string num;
        std::string unit;
        fields >> num >> unit;
        uint64_t v = 0;
        if (!machine_parse_u64(num, v)) {
            return false;
        }
        bytes = unit == "kB" ? v*1024 : v;
        return true;
    }
    return false;
}

bool llama_expert_machine_parse_meminfo(const std::string & text, uint64_t & total, uint64_t & available) {
    total = 0;
    available = 0;
    machine_kb_field(text, "MemTotal", total);
    return machine_kb_field(text, "MemAvailable", available);
}

uint64_t llama_expert_runtime_baseline(uint64_t held, uint64_t context) {
    if (held == 0) {
        return LLAMA_EXPERT_RUNTIME_BASELINE;
    }
    return (held > context ? held - context : 0) + LLAMA_EXPERT_RUNTIME_GROWTH;
}

uint64_t llama_expert_machine_parse_rss_anon(const std::string & text) {
    uint64_t v = 0;
    return machine_kb_field(text, "RssAnon", v) ? v : 0;
}

bool llama_expert_machine_parse_cgroup(const std::string & text, int & version, std::string & path) {
    std::istringstream in(text);
    std::string line;
    bool v2 = false;
    std::string v2_path;
    while (std::getline(in, line)) {
        // hierarchy-ID:controller-list:path (the path may contain ':')
        const size_t c1 = line.find(':');
        const size_t c2 = c1 == std::string::npos ? std::string::npos : line.find(':', c1 + 1);
        if (c2 == std::string::npos) {
            continue;
        }
        const std::string ctrls = line.substr(c1 + 1, c2 - c1 - 1);
        const std::string p     = line.substr(c2 + 1);
        if (p.empty() || p[0] != '/' || p.find("/..") != std::string::npos) {
            continue; // outside our cgroup namespace ("/../..") or damaged
        }
        if (line.compare(0, c1, "0") == 0 && ctrls.empty()) {
            v2 = true;
            v2_path = p;
            continue;
        }
        std::istringstream cs(ctrls);
        std::string ctrl;
        while (std::getline(cs, ctrl, ',')) {
            if (ctrl == "memory") {
                version = 1;
                path = p;
                return true;
            }
        }
    }
    if (v2) {
        version = 2;
        path = v2_path;
        return true;
    }
    return false;
}

bool llama_expert_machine_parse_limit(const std::string & text, uint64_t & limit) {
    std::string t = text;
    while (!t.empty() && (t.back() == '\n' || t.back() == ' ' || t.back() == '\r')) {
        t.pop_back();
    }
    if (t == "max") {
        limit = 0;
        return true;
    }
    uint64_t v = 0;
    if (!machine_parse_u64(t, v)) {
        return false;
    }
    // v1's "no limit" is PAGE_COUNTER_MAX pages: 2^63-1 rounded down to a page (9223372036854771712 with 4 KiB pages)
    limit = v >= (1ull << 62) ? 0 : v;
    return true;
}

uint64_t llama_expert_machine_parse_stat(const std::string & text, const std::string & key) {
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
        const size_t sp = line.find(' ');
        if (sp != std::string::npos && line.compare(0, sp, key) == 0) {
            uint64_t v = 0;
            return machine_parse_u64(line.substr(sp + 1), v) ? v : 0;
        }
    }
    return 0;
}

uint64_t llama_expert_machine::usable() const {
    uint64_t u = UINT64_MAX;
    if (mem_available > 0) {
        u = mem_available + self_anon;
    }
    if (cgroup_limit > 0) {
        const uint64_t others = cgroup_charged > self_anon ? cgroup_charged - self_anon : 0;
        u = std::min<uint64_t>(u, cgroup_limit > others ? cgroup_limit - others : 0);
    }
    return u;
}

std::string llama_expert_machine::describe() const {
    std::string s;
    if (cgroup_limit > 0) {
        const uint64_t others = cgroup_charged > self_anon ? cgroup_charged - self_anon : 0;
        s = "the memory cgroup " + cgroup + " (v" + std::to_string(cgroup_version) + ", limit " +
            machine_mib(cgroup_limit) + ", " + machine_mib(others) + " used by others)";
    }
    if (mem_available > 0) {
        s += (s.empty() ? "" : " and ") + std::string("MemAvailable ") + machine_mib(mem_available);
        if (self_anon > 0) {
            s += " (+" + machine_mib(self_anon) + " this process holds)";
        }
    }
    return s.empty() ? "no memory facts (no /proc/meminfo, no memory cgroup)" : s;
}

llama_expert_machine llama_expert_machine_read(const llama_expert_machine_reader & read) {
    llama_expert_machine m;
    std::string text;
    if (read("/proc/meminfo", text)) {
        llama_expert_machine_parse_meminfo(text, m.mem_total, m.mem_available);
    }
    if (read("/proc/self/status", text)) {
        m.self_anon = llama_expert_machine_parse_rss_anon(text);
    }
    int version = 0;
    std::string path;
    if (!read("/proc/self/cgroup", text) || !llama_expert_machine_parse_cgroup(text, version, path)) {
        return m;
    }
    m.cgroup_version = version;
    const std::string root = version == 2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/memory";
    const char * limit_file = version == 2 ? "memory.max"     : "memory.limit_in_bytes";
    const char * usage_file = version == 2 ? "memory.current" : "memory.usage_in_bytes";
    // this cgroup, then each parent up to the hierarchy's root (in a cgroup namespace our own cgroup is the root
    // that /sys/fs/cgroup shows, and its files are read there): the tightest headroom binds
    std::string p = path;
    while (!p.empty() && p.back() == '/') {
        p.pop_back();
    }
    uint64_t best = UINT64_MAX;
    for (;;) {
        const std::string dir = root + p;
        uint64_t limit = 0;
        if (read(dir + "/" + limit_file, text) && llama_expert_machine_parse_limit(text, limit) && limit > 0) {
            uint64_t usage = 0;
            if (read(dir + "/" + usage_file, text)) {
                machine_parse_u64(text, usage);
            }
            uint64_t cache = 0;
            if (read(dir + "/memory.stat", text)) {
                cache = version == 2 ? llama_expert_machine_parse_stat(text, "file")
                                     : llama_expert_machine_parse_stat(text, "total_cache");
                if (version == 1 && cache == 0) {
                    cache = llama_expert_machine_parse_stat(text, "cache");
                }
            }
            const uint64_t charged = usage > cache ? usage - cache : 0;
            const uint64_t others  = charged > m.self_anon ? charged - m.self_anon : 0;
            const uint64_t room    = limit > others ? limit - others : 0;
            if (room < best) {
                best = room;
                m.cgroup         = p.empty() ? "/" : p;
                m.cgroup_limit   = limit;
                m.cgroup_charged = charged;
            }
        }
        if (p.empty()) {
            break;
        }
        p = p.substr(0, p.rfind('/'));
    }
    return m;
}

llama_expert_machine llama_expert_machine_current() {
    const char * env = getenv(LLAMA_EXPERT_MACHINE_ROOT_ENV);
    const std::string prefix = env ? env : "";
    return llama_expert_machine_read([&prefix](const std::string & path, std::string & contents) {
        std::ifstream f(prefix + path, std::ios::binary);
        if (!f) {
            return false;
        }
        std::ostringstream ss;
        ss << f.rdbuf();
        contents = ss.str();
        return !f.bad();
    });
}
