#include "llama-expert-spec.h"

#include "llama-expert-budget.h"
#include "llama-expert-paths.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

//
// configuration
//

const char * llama_expert_evict_name(llama_expert_evict evict) {
    switch (evict) {
        case LLAMA_EXPERT_EVICT_LFU: return "lfu";
        case LLAMA_EXPERT_EVICT_LRU: return "lru";
        case LLAMA_EXPERT_EVICT_CLASSLRU: return "classlru";
    }
    return "?";
}

const char * llama_expert_cache_mode_name(llama_expert_cache_mode mode) {
    switch (mode) {
        case LLAMA_EXPERT_CACHE_MODE_OFF:     return "off";
        case LLAMA_EXPERT_CACHE_MODE_EMULATE: return "emulate";
        case LLAMA_EXPERT_CACHE_MODE_ENGINE:  return "engine";
    }
    return "?";
}

static bool parse_float(const std::string & s, float & out) {
    if (s.empty()) {
        return false;
    }
    char * end = nullptr;
    errno = 0;
    const double v = std::strtod(s.c_str(), &end);
    if (errno != 0 || end == s.c_str() || *end != '\0' || !std::isfinite(v)) {
        return false;
    }
    out = (float) v;
    return true;
}

static bool parse_uint(const std::string & s, uint64_t & out) {
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 18) {
        return false;
    }
    out = std::strtoull(s.c_str(), nullptr, 10);
    return true;
}

// A size as the harness parses it (harness/sizes.py; tests/test_sizes.py proves both agree): a number, then an
// optional unit, case-insensitive: none or B (bytes), K M G T and KiB MiB GiB TiB (powers of 1024: a "24G" card
// has 24 GiB), KB MB GB TB (powers of 1000). E.g. 24G, 24GiB, 24GB, 512M, 1.5G, 123456.
static bool parse_size(const std::string & s, uint64_t & out) {
    size_t n = 0;
    while (n < s.size() && (std::isdigit((unsigned char) s[n]) || s[n] == '.')) {
        ++n;
    }
    std::string unit = s.substr(n);
    for (char & c : unit) {
        c = (char) std::toupper((unsigned char) c);
    }
    static const struct { const char * name; double mult; } units[] = {
        { "",    1.0 }, { "B",   1.0 },
        { "K",   1024.0 }, { "KIB", 1024.0 }, { "M",   1048576.0 }, { "MIB", 1048576.0 },
        { "G",   1073741824.0 }, { "GIB", 1073741824.0 }, { "T",   1099511627776.0 }, { "TIB", 1099511627776.0 },
        { "KB",  1e3 }, { "MB",  1e6 }, { "GB",  1e9 }, { "TB",  1e12 },
    };
    double mult = 0.0;
    for (const auto & u : units) {
        if (unit == u.name) {
            mult = u.mult;
        }
    }
    const std::string num = s.substr(0, n);
    if (num.empty() || mult == 0.0 || num.front() == '.' || num.back() == '.' || num.find('.') != num.rfind('.')) {
        return false;
    }
    char * end = nullptr;
    errno = 0;
    const double d = std::strtod(num.c_str(), &end);
    if (errno != 0 || *end != '\0' || !std::isfinite(d) || d < 0.0 || d * mult > 1.8e19) {
        return false;
    }
    out = (uint64_t) (d * mult);
    return true;
}

// user text in an error message: control and non-ASCII bytes as \xNN, so that every error stays one line
static std::string shown(const std::string & s) {
    std::string o;
    for (unsigned char c : s) {
        if (c < 0x20 || c >= 0x7f) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\x%02x", c);
            o += buf;
        } else {
            o += (char) c;
        }
    }
    return o;
}

// a residency: a count of experts per layer (>= 1), or a percentage in (0, 100] ("25%"); sets the one given and
// clears the other (count -1: the percentage applies)
static bool parse_residency(const std::string & val, int32_t & count, float & pct) {
    if (!val.empty() && val.back() == '%') {
        float v;
        if (!parse_float(val.substr(0, val.size() - 1), v) || v <= 0.0f || v > 100.0f) {
            return false;
        }
        pct   = v;
        count = -1;
        return true;
    }
    uint64_t v;
    if (!parse_uint(val, v) || v == 0 || v > INT32_MAX) {
        return false;
    }
    count = (int32_t) v;
    return true;
}

// the experts per layer of a residency parsed by parse_residency (a percentage: rounded, at least 1)
static int32_t residency_n(int32_t count, float pct, int32_t n_expert) {
    return count >= 0 ? count : llama_expert_slots_for_residency(n_expert, pct);
}

static bool bad_value(std::string & err, const std::string & key, const std::string & val, const char * accepted) {
    err = "bad value '" + shown(val) + "' for key '" + shown(key) + "' (accepted: " + accepted + ")";
    return false;
}

//
// the spec keys: one parser per row of LLAMA_EXPERT_SPEC_KEYS; false: the value is refused (the error names the
// row's accepted values)
//

static bool spec_key_mode(const std::string & val, llama_expert_cache_config & cfg) {
    if      (val == "off")     { cfg.mode = LLAMA_EXPERT_CACHE_MODE_OFF; }
    else if (val == "emulate") { cfg.mode = LLAMA_EXPERT_CACHE_MODE_EMULATE; }
    else if (val == "engine")  { cfg.mode = LLAMA_EXPERT_CACHE_MODE_ENGINE; }
    else { return false; }
    return true;
}

// a preset, applied before the explicit keys
static bool spec_key_policy(const std::string & val, llama_expert_cache_config & cfg) {
    if (val == "quality") {
        cfg.rule  = LLAMA_EXPERT_MISS_THRESHOLD;
        cfg.tau   = 0.15f;
        cfg.evict = LLAMA_EXPERT_EVICT_LFU;
        cfg.admit = true;
        cfg.beta  = 0.5f;
    } else if (val == "speed") {
        cfg.rule  = LLAMA_EXPERT_MISS_FIRST_CHOICE;
        cfg.evict = LLAMA_EXPERT_EVICT_LFU;
        cfg.admit = true;
        cfg.beta  = 0.5f;
    } else if (val == "fetch-all") {
        cfg.rule  = LLAMA_EXPERT_MISS_FETCH_ALL;
        cfg.evict = LLAMA_EXPERT_EVICT_LRU;
        cfg.admit = false;
    } else if (val == "drop-light") {
        // colibri's DEGRADE_ZERO at tau 0.2 (no renormalisation): misses with gate weight < 0.2 dropped, the others
        // fetched; from the side-by-side frontier on the trained model (eval/study-tinymoe/frontier)
        cfg.rule  = LLAMA_EXPERT_MISS_ZERO;
        cfg.tau   = 0.2f;
        cfg.evict = LLAMA_EXPERT_EVICT_LFU;
        cfg.admit = false;
    } else {
        return false;
    }
    cfg.preset = val;
    return true;
}

static bool spec_key_rule(const std::string & val, llama_expert_cache_config & cfg) {
    const llama_expert_rule * r = llama_expert_rule_find(val.c_str());
    if (!r) {
        return false;
    }
    cfg.rule = r->id;
    return true;
}

static bool parse_unit(const std::string & val, float & out) {
    float v;
    if (!parse_float(val, v) || v < 0.0f || v > 1.0f) {
        return false;
    }
    out = v;
    return true;
}

static bool parse_int(const std::string & val, uint64_t lo, uint64_t hi, uint64_t & out) {
    uint64_t v;
    if (!parse_uint(val, v) || v < lo || v > hi) {
        return false;
    }
    out = v;
    return true;
}

// a choice of two words: sets out to whether val is `yes`
static bool parse_choice(const std::string & val, const char * yes, const char * no, bool & out) {
    if (val == yes) {
        out = true;
    } else if (val == no) {
        out = false;
    } else {
        return false;
    }
    return true;
}

static bool spec_key_tau(const std::string & val, llama_expert_cache_config & cfg)      { return parse_unit(val, cfg.tau); }
static bool spec_key_tau_file(const std::string & val, llama_expert_cache_config & cfg) { return parse_unit(val, cfg.tau_file); }
static bool spec_key_alpha(const std::string & val, llama_expert_cache_config & cfg)    { return parse_unit(val, cfg.route_alpha); }
static bool spec_key_t(const std::string & val, llama_expert_cache_config & cfg)        { return parse_unit(val, cfg.ser_t); }
static bool spec_key_lo(const std::string & val, llama_expert_cache_config & cfg)       { return parse_unit(val, cfg.band_lo); }
static bool spec_key_hi(const std::string & val, llama_expert_cache_config & cfg)       { return parse_unit(val, cfg.band_hi); }
static bool spec_key_mass(const std::string & val, llama_expert_cache_config & cfg)     { return parse_unit(val, cfg.budget_mass); }

static bool spec_key_j(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, 65536, v) && (cfg.route_j = (int32_t) v, true);
}

static bool spec_key_m(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    if (val == "auto") {
        cfg.route_m = 0;
        return true;
    }
    return parse_int(val, 1, 1000000, v) && (cfg.route_m = (int32_t) v, true);
}

static bool spec_key_kmin(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 1, 65536, v) && (cfg.ser_kmin = (int32_t) v, true);
}

static bool spec_key_min_rank(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, 65536, v) && (cfg.band_min_rank = (int32_t) v, true);
}

static bool spec_key_max_rank(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, 65536, v) && (cfg.band_max_rank = (int32_t) v, true);
}

static bool spec_key_renorm(const std::string & val, llama_expert_cache_config & cfg)   { return parse_choice(val, "on", "off", cfg.renorm); }
static bool spec_key_light(const std::string & val, llama_expert_cache_config & cfg)    { return parse_choice(val, "host", "substitute", cfg.light_host); }
static bool spec_key_prefetch(const std::string & val, llama_expert_cache_config & cfg) { return parse_choice(val, "on", "off", cfg.prefetch); }
static bool spec_key_prefetch_max(const std::string & val, llama_expert_cache_config & cfg) {
    if (val == "all") {
        cfg.prefetch_max = 0;
        return true;
    }
    uint64_t v;
    return parse_int(val, 1, 65536, v) && (cfg.prefetch_max = (int32_t) v, true);
}
static bool spec_key_host(const std::string & val, llama_expert_cache_config & cfg)     { return parse_choice(val, "file", "ram", cfg.host_file); }

static bool spec_key_evict(const std::string & val, llama_expert_cache_config & cfg) {
    if      (val == "lfu")      { cfg.evict = LLAMA_EXPERT_EVICT_LFU; }
    else if (val == "lru")      { cfg.evict = LLAMA_EXPERT_EVICT_LRU; }
    else if (val == "classlru") { cfg.evict = LLAMA_EXPERT_EVICT_CLASSLRU; }
    else { return false; }
    return true;
}

static bool spec_key_half_life(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 1, UINT32_MAX, v) && (cfg.classlru_half_life = (uint32_t) v, true);
}

static bool spec_key_classes(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 1, 32, v) && (cfg.classlru_classes = (uint32_t) v, true);
}

static bool spec_key_admit(const std::string & val, llama_expert_cache_config & cfg) {
    float v;
    if (val == "off") {
        cfg.admit = false;
    } else if (val == "on") {
        cfg.admit = true;
    } else if (parse_float(val, v) && v > 0.0f) {
        cfg.admit = true;
        cfg.beta  = v;
    } else {
        return false;
    }
    return true;
}

static bool spec_key_halve(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, UINT32_MAX, v) && (cfg.lfu_halve = (uint32_t) v, true);
}

// the slots' residency, or (ram_slots) the RAM tier's (three tiers: slots <- RAM tier <- model file)
static bool spec_key_slots(const std::string & val, llama_expert_cache_config & cfg) {
    return parse_residency(val, cfg.slots_count, cfg.slots_pct);
}

static bool spec_key_ram_slots(const std::string & val, llama_expert_cache_config & cfg) {
    return parse_residency(val, cfg.ram_slots_count, cfg.ram_slots_pct);
}

static bool spec_key_ram(const std::string & val, llama_expert_cache_config & cfg) {
    return parse_size(val, cfg.ram) && cfg.ram != 0;
}

static bool spec_key_runtime(const std::string & val, llama_expert_cache_config & cfg) {
    return parse_size(val, cfg.runtime) && cfg.runtime != 0;
}

static bool spec_key_vram(const std::string & val, llama_expert_cache_config & cfg) {
    return parse_size(val, cfg.vram) && cfg.vram != 0;
}

static bool spec_key_vram_reserve(const std::string & val, llama_expert_cache_config & cfg) {
    return parse_size(val, cfg.vram_reserve);
}

static bool spec_key_bypass(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, INT32_MAX, v) && v != 1 && (cfg.bypass = (uint32_t) v, true);
}

static bool spec_key_group(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    if (val == "auto") {
        cfg.group = -1;
        return true;
    }
    return parse_int(val, 0, 65536, v) && (cfg.group = (int32_t) v, true);
}

static bool spec_key_async(const std::string & val, llama_expert_cache_config & cfg) {
    if      (val == "auto")   { cfg.async = LLAMA_EXPERT_ASYNC_AUTO; }
    else if (val == "off")    { cfg.async = LLAMA_EXPERT_ASYNC_OFF; }
    else if (val == "thread") { cfg.async = LLAMA_EXPERT_ASYNC_THREAD; }
    else { return false; }
    return true;
}

static bool spec_key_readers(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 1, 64, v) && (cfg.readers = (int32_t) v, true);
}

static bool spec_key_direct(const std::string & val, llama_expert_cache_config & cfg) {
    if      (val == "auto") { cfg.direct = LLAMA_EXPERT_DIRECT_AUTO; }
    else if (val == "on")   { cfg.direct = LLAMA_EXPERT_DIRECT_ON; }
    else if (val == "off")  { cfg.direct = LLAMA_EXPERT_DIRECT_OFF; }
    else { return false; }
    return true;
}

static bool spec_key_pack(const std::string & val, llama_expert_cache_config & cfg) {
    if (val.empty()) {
        return false;
    }
    cfg.pack = val == "auto" ? "" : val;
    return true;
}

static bool parse_path(const std::string & val, std::string & out) {
    if (val.empty()) {
        return false;
    }
    out = val;
    return true;
}

static bool spec_key_profile(const std::string & val, llama_expert_cache_config & cfg)     { return parse_path(val, cfg.profile); }
static bool spec_key_profile_out(const std::string & val, llama_expert_cache_config & cfg) { return parse_path(val, cfg.profile_out); }
static bool spec_key_stats(const std::string & val, llama_expert_cache_config & cfg)       { return parse_path(val, cfg.stats); }

static bool spec_key_profile_every(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, UINT32_MAX, v) && (cfg.profile_every = (uint32_t) v, true);
}
static bool spec_key_trace(const std::string & val, llama_expert_cache_config & cfg)       { return parse_path(val, cfg.trace); }

static bool spec_key_shadow(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, UINT32_MAX, v) && (cfg.shadow = (uint32_t) v, true);
}

static bool spec_key_trace_top(const std::string & val, llama_expert_cache_config & cfg) {
    uint64_t v;
    return parse_int(val, 0, 65536, v) && (cfg.trace_top = (uint32_t) v, true);
}

struct spec_key {
    const char * name;
    bool (*parse)(const std::string & val, llama_expert_cache_config & cfg);
    const char * accepted;
};

static const spec_key SPEC_KEYS[] = {
#define LLAMA_EXPERT_SPEC_KEY_ROW(key, accepted) { #key, spec_key_##key, accepted },
    LLAMA_EXPERT_SPEC_KEYS(LLAMA_EXPERT_SPEC_KEY_ROW)
#undef LLAMA_EXPERT_SPEC_KEY_ROW
};

static const spec_key * spec_key_find(const std::string & name) {
    for (const spec_key & k : SPEC_KEYS) {
        if (name == k.name) {
            return &k;
        }
    }
    return nullptr;
}

// "mode, policy, rule, ...": the keys as the errors list them
static std::string spec_key_names() {
    std::string s;
    for (const spec_key & k : SPEC_KEYS) {
        s += (s.empty() ? "" : ", ") + std::string(k.name);
    }
    return s;
}

// the rules' names with a property (all: every rule), ", "-separated
static std::string rule_names(bool (*has)(const llama_expert_rule & r)) {
    std::string s;
    for (int32_t i = 0; i < LLAMA_EXPERT_N_RULES; ++i) {
        if (!has || has(LLAMA_EXPERT_RULES[i])) {
            s += (s.empty() ? "" : ", ") + std::string(LLAMA_EXPERT_RULES[i].name);
        }
    }
    return s;
}

// the value refused by a row's parser
static bool bad_key_value(std::string & err, const spec_key & k, const std::string & val) {
    const std::string accepted = k.accepted ? k.accepted : rule_names(nullptr);
    return bad_value(err, k.name, val, accepted.c_str());
}

// a rule's own key given with another rule: "tau applies to rule=threshold (policy=quality) or rule=zero, not to
// rule=first-choice: remove tau, or use rule=threshold"; false when no rule owns the key or the rule does
static bool key_of_another_rule(const std::string & key, llama_expert_miss_rule rule, std::string & err) {
    std::string owners;
    const llama_expert_rule * first = nullptr;
    for (int32_t i = 0; i < LLAMA_EXPERT_N_RULES; ++i) {
        const llama_expert_rule & r = LLAMA_EXPERT_RULES[i];
        if (llama_expert_rule_owns(r, key.c_str())) {
            if (r.id == rule) {
                return false;
            }
            owners += (owners.empty() ? "rule=" : " or rule=") + std::string(r.name) + r.shown;
            first = first ? first : &r;
        }
    }
    if (!first) {
        return false;
    }
    err = key + " applies to " + owners + ", not to rule=" + llama_expert_miss_rule_name(rule) + ": remove " + key +
        ", or use rule=" + first->name;
    return true;
}

// the files the path keys name are distinct (llama_expert_path_same): stats=, trace= and profile_out= each write their
// own file at the end, and one on another's path destroys both (the last write replaces the first, the run exits 0);
// profile= is read at the start, so only profile_out= may name it (a profile updated in place)
static bool spec_check_paths_differ(const llama_expert_cache_config & cfg, std::string & err) {
    const struct { const char * key; const std::string * path; } files[] = {
        { "profile", &cfg.profile }, { "profile_out", &cfg.profile_out }, { "stats", &cfg.stats }, { "trace", &cfg.trace },
    };
    for (size_t i = 0; i < std::size(files); ++i) {
        for (size_t j = i + 1; j < std::size(files); ++j) {
            const auto & a = files[i], & b = files[j];
            if (a.path->empty() || b.path->empty() || (a.path == &cfg.profile && b.path == &cfg.profile_out)) {
                continue;
            }
            if (llama_expert_path_same(*a.path, *b.path)) {
                err = std::string(a.key) + "=" + shown(*a.path) + " and " + b.key + "=" + shown(*b.path) +
                    " name the same file: one would overwrite the other; give each its own path";
                return false;
            }
        }
    }
    return true;
}

using spec_kv = std::vector<std::pair<std::string, std::string>>;

// the spec's items: "k=v,k=v" (and the mode shorthands) into key-value pairs, each key once
static bool spec_split(const std::string & spec, spec_kv & kv, std::string & err) {
    // split "k=v,k=v"
    size_t pos = 0;
    while (pos <= spec.size()) {
        size_t end = spec.find(',', pos);
        if (end == std::string::npos) {
            end = spec.size();
        }
        std::string item = spec.substr(pos, end - pos);
        // trim spaces
        while (!item.empty() && std::isspace((unsigned char) item.front())) { item.erase(item.begin()); }
        while (!item.empty() && std::isspace((unsigned char) item.back()))  { item.pop_back(); }
        if (!item.empty()) {
            const size_t eq = item.find('=');
            if (eq == std::string::npos) {
                if (item == "off" || item == "emulate" || item == "engine") {
                    kv.emplace_back("mode", item); // shorthand: "off", "emulate", "engine"
                } else {
                    err = "'" + shown(item) + "' is not key=value (accepted keys: " + spec_key_names() + ")";
                    return false;
                }
            } else {
                // spaces around the key and the value are trimmed too ("tau = 0.2")
                std::string k = item.substr(0, eq), v = item.substr(eq + 1);
                while (!k.empty() && std::isspace((unsigned char) k.back()))  { k.pop_back(); }
                while (!v.empty() && std::isspace((unsigned char) v.front())) { v.erase(v.begin()); }
                kv.emplace_back(k, v);
            }
        }
        pos = end + 1;
    }

    // each key once: a second value would silently win
    for (size_t i = 0; i < kv.size(); ++i) {
        for (size_t j = 0; j < i; ++j) {
            if (kv[i].first == kv[j].first) {
                err = "key '" + shown(kv[i].first) + "' is given twice ('" + shown(kv[j].second) + "' and '" + shown(kv[i].second) +
                    "'): give it once";
                return false;
            }
        }
    }

    return true;
}

// the keys that belong to a rule, an eviction or a light-miss handling, against the rule the spec chose
static bool spec_check_rule_keys(llama_expert_cache_config & cfg, const spec_kv & kv, std::string & err) {
    const llama_expert_miss_rule rule = cfg.rule;
    const llama_expert_rule &    row  = llama_expert_rule_of(rule);
    if (rule == LLAMA_EXPERT_MISS_BAND && !(cfg.band_lo < cfg.band_hi)) {
        err = "rule=band substitutes the misses with gate weight in [lo, hi): lo (" + std::to_string(cfg.band_lo) +
            ") must be below hi (" + std::to_string(cfg.band_hi) + ")";
        return false;
    }
    if (rule == LLAMA_EXPERT_MISS_BAND && cfg.band_max_rank >= 0 && cfg.band_min_rank > cfg.band_max_rank) {
        err = "rule=band substitutes at the ranks in [min_rank, max_rank]: min_rank (" + std::to_string(cfg.band_min_rank) +
            ") must not be above max_rank (" + std::to_string(cfg.band_max_rank) + ")";
        return false;
    }
    for (const auto & [key, val] : kv) {
        if (key_of_another_rule(key, rule, err)) {
            return false;
        }
        if (key == "ram_slots" && !cfg.host_file && cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF) {
            err = "ram_slots is a RAM tier between the slots and the model file: it needs host=file";
            return false;
        }
        if (key == "tau_file" && !cfg.host_file && cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF) {
            err = "tau_file is the threshold for misses read from the model file: it needs host=file";
            return false;
        }
        if ((key == "m" || key == "alpha") && cfg.light_host) {
            err = key + " chooses and weighs substitutes, and light=host computes every light miss on the host: remove " +
                key + ", or use light=substitute";
            return false;
        }
        if (key == "renorm" && !row.drops) {
            err = "renorm applies to the rules that drop (" + rule_names([](const llama_expert_rule & r) { return r.drops; }) +
                "), not to rule=" + row.name + ": remove renorm";
            return false;
        }
        if (key == "light" && !row.substitutes) {
            err = "light applies to the rules that substitute (" +
                rule_names([](const llama_expert_rule & r) { return r.substitutes; }) + "), not to rule=" + row.name +
                ": remove light";
            return false;
        }
        if ((key == "half_life" || key == "classes") && cfg.evict != LLAMA_EXPERT_EVICT_CLASSLRU) {
            err = key + " applies to evict=classlru, not to evict=" + llama_expert_evict_name(cfg.evict) + ": remove " + key +
                ", or use evict=classlru";
            return false;
        }
        if (cfg.mode == LLAMA_EXPERT_CACHE_MODE_OFF && key != "mode") {
            // not an error (scripts switch the mode of a spec on and off), but said when the context is made
            cfg.off_ignored += (cfg.off_ignored.empty() ? "" : ", ") + shown(key);
        }
    }
    return true;
}

// the keys of the budget, the tiers, the reads, the prefetch and the output files, against each other and the mode
static bool spec_check_tier_keys(const llama_expert_cache_config & cfg, const spec_kv & kv, std::string & err) {
    if (cfg.shadow > 0 && cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE) {
        err = "shadow= computes a ubatch exactly with the full expert tensors, which mode=engine's banks replace: use mode=emulate";
        return false;
    }
    if (cfg.profile_every > 0 && cfg.profile_out.empty() && cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF) {
        err = "profile_every= writes the profile_out= file during the run: it needs profile_out=";
        return false;
    }
    if (cfg.ram > 0 && cfg.vram > 0) {
        err = "ram= and vram= are two budgets for the same banks: give one (vram= where the banks are on a GPU)";
        return false;
    }
    if ((cfg.ram > 0 || cfg.vram > 0) &&
            std::any_of(kv.begin(), kv.end(), [](const auto & p) { return p.first == "slots"; })) {
        err = std::string("slots= and ") + (cfg.ram > 0 ? "ram=" : "vram=") + " both set the residency (a budget "
            "computes the slots that fit in it): give one";
        return false;
    }
    if (cfg.ram > 0 && !cfg.host_file) {
        err = "ram= budgets RAM with the experts left in the model file: it needs host=file";
        return false;
    }
    if (cfg.runtime > 0 && cfg.ram == 0) {
        err = "runtime= is a term of the ram= budget (what the process holds besides weights, context, reserve and "
            "banks): it needs ram=";
        return false;
    }
    for (const char * k : { "readers", "direct", "pack" }) {
        const bool given = std::any_of(kv.begin(), kv.end(), [k](const auto & p) { return p.first == k; });
        if (given && !cfg.host_file && cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF) {
            err = std::string(k) + "= sets how host=file reads experts from the model file: it needs host=file";
            return false;
        }
    }
    if (cfg.host_file && cfg.mode == LLAMA_EXPERT_CACHE_MODE_EMULATE) {
        // emulate simulates the tiers: misses come from the file (tau_file), nothing is read
        for (const auto & [key, val] : kv) {
            if (key == "readers" || key == "direct" || key == "pack") {
                err = key + "= sets how mode=engine reads the model file: emulate reads nothing";
                return false;
            }
        }
    }
    if (cfg.prefetch && cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE && cfg.async == LLAMA_EXPERT_ASYNC_OFF) {
        err = "prefetch=on copies the predicted experts in the background, and async=off makes every copy synchronous (it "
            "would delay the token): remove one of prefetch=on and async=off";
        return false;
    }
    if (!cfg.prefetch && cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF &&
            std::any_of(kv.begin(), kv.end(), [](const auto & p) { return p.first == "prefetch_max"; })) {
        err = "prefetch_max= limits the experts prefetch=on admits per layer and token: it needs prefetch=on";
        return false;
    }
    if (cfg.light_host && cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE) {
        err = "light=host (experts computed on the host) is not implemented in mode=engine yet: use mode=emulate, or light=substitute";
        return false;
    }
    if (cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF && !spec_check_paths_differ(cfg, err)) {
        return false;
    }
    return true;
}

bool llama_expert_cache_config_parse(const std::string & spec, llama_expert_cache_config & cfg, std::string & err) {
    cfg = llama_expert_cache_config();
    cfg.spec = spec;

    spec_kv kv;
    if (!spec_split(spec, kv, err)) {
        return false;
    }

    if (kv.empty()) {
        return true; // empty spec: off
    }

    // defaults when a spec is given: emulate; the preset is applied before the explicit keys
    cfg.mode = LLAMA_EXPERT_CACHE_MODE_EMULATE;
    for (const auto & [key, val] : kv) {
        if (key == "policy" && !spec_key_policy(val, cfg)) {
            return bad_key_value(err, *spec_key_find(key), val);
        }
    }

    bool explicit_rule = false;
    bool explicit_tau  = false;
    for (const auto & [key, val] : kv) {
        const spec_key * k = spec_key_find(key);
        if (!k) {
            err = "unknown key '" + shown(key) + "' (accepted keys: " + spec_key_names() + ")";
            return false;
        }
        if (key == "policy") {
            continue;
        }
        if (!k->parse(val, cfg)) {
            return bad_key_value(err, *k, val);
        }
        // the path keys (the table's "a file path" rows): a FIFO would block open()
        if (k->accepted && std::strcmp(k->accepted, "a file path") == 0 && !llama_expert_path_check(key + "=", val, err)) {
            return false;
        }
        if (key == "pack" && val != "auto" && val != "off" && !llama_expert_path_check(key + "=", val, err)) {
            return false;
        }
        explicit_rule = explicit_rule || key == "rule";
        explicit_tau  = explicit_tau  || key == "tau";
    }
    if (explicit_rule) {
        cfg.preset = "custom";
    }
    if (cfg.rule == LLAMA_EXPERT_MISS_ZERO && !explicit_tau && cfg.preset != "drop-light") {
        cfg.tau = 0.03f; // colibri DEGRADE_ZERO's default (policy=drop-light: its own 0.2)
    }
    return spec_check_rule_keys(cfg, kv, err) && spec_check_tier_keys(cfg, kv, err);
}

bool llama_expert_cache_config_check_k(const llama_expert_cache_config & cfg, int32_t k, int32_t n_expert, std::string & err) {
    const std::string ks = std::to_string(k), es = std::to_string(n_expert);
    if (cfg.rule == LLAMA_EXPERT_MISS_CACHE_ROUTE) {
        if (cfg.route_j > k) {
            return bad_value(err, "j", std::to_string(cfg.route_j), ("a number of ranks in [0, " + ks + "], the experts used per token").c_str());
        }
        if (cfg.route_m != 0 && (cfg.route_m < k || cfg.route_m > n_expert)) {
            return bad_value(err, "m", std::to_string(cfg.route_m),
                ("a window of router ranks in [" + ks + ", " + es + "] (the experts used per token, the experts per layer), or auto").c_str());
        }
    }
    if (cfg.rule == LLAMA_EXPERT_MISS_BAND && cfg.band_min_rank > k) {
        return bad_value(err, "min_rank", std::to_string(cfg.band_min_rank), ("a rank in [0, " + ks + "], the experts used per token").c_str());
    }
    if (cfg.rule == LLAMA_EXPERT_MISS_BAND && cfg.band_max_rank >= k) {
        return bad_value(err, "max_rank", std::to_string(cfg.band_max_rank),
            ("a rank in [0, " + std::to_string(k - 1) + "], below the experts used per token (" + ks + ")").c_str());
    }
    if (cfg.rule == LLAMA_EXPERT_MISS_SER && cfg.ser_kmin > k) {
        return bad_value(err, "kmin", std::to_string(cfg.ser_kmin), ("a number of ranks in [1, " + ks + "], the experts used per token").c_str());
    }
    const int32_t n_ram = llama_expert_cache_config_n_ram_slots(cfg, n_expert);
    if (cfg.host_file && (cfg.ram_slots_count >= 0 || cfg.ram_slots_pct > 0.0f) && (n_ram < k || n_ram > n_expert)) {
        return bad_value(err, "ram_slots", std::to_string(n_ram),
            ("a RAM tier of " + ks + " to " + es + " experts per layer (at least the experts used per token)").c_str());
    }
    return true;
}

bool llama_expert_cache_config_scales_weights(const llama_expert_cache_config & cfg) {
    const llama_expert_rule & r = llama_expert_rule_of(cfg.rule);
    return r.drops || (r.windowed && cfg.route_alpha != 1.0f);
}

int32_t llama_expert_cache_config_n_ram_slots(const llama_expert_cache_config & cfg, int32_t n_expert) {
    if (!cfg.host_file || (cfg.ram_slots_count < 0 && !(cfg.ram_slots_pct > 0.0f))) {
        return 0;
    }
    return residency_n(cfg.ram_slots_count, cfg.ram_slots_pct, n_expert);
}

int32_t llama_expert_cache_config_n_slots(const llama_expert_cache_config & cfg, int32_t n_expert) {
    return residency_n(cfg.slots_count, cfg.slots_pct, n_expert);
}

llama_expert_params llama_expert_cache_config_params(const llama_expert_cache_config & cfg) {
    llama_expert_params p;
    p.tau                = cfg.tau;
    p.tau_file           = cfg.tau_file >= 0.0f ? cfg.tau_file : cfg.tau;
    p.host_file          = cfg.host_file;
    p.evict              = cfg.evict;
    p.admit              = cfg.admit;
    p.beta               = cfg.beta;
    p.lfu_halve          = cfg.lfu_halve;
    p.classlru_half_life = cfg.classlru_half_life;
    p.classlru_classes   = cfg.classlru_classes;
    p.route_j            = cfg.route_j;
    p.route_m            = cfg.route_m;
    p.route_alpha        = cfg.route_alpha;
    p.ser_kmin           = cfg.ser_kmin;
    p.ser_t              = cfg.ser_t;
    p.band_lo            = cfg.band_lo;
    p.band_hi            = cfg.band_hi;
    p.band_min_rank      = cfg.band_min_rank;
    p.band_max_rank      = cfg.band_max_rank;
    p.budget_mass        = cfg.budget_mass;
    p.renorm             = cfg.renorm;
    p.light_host         = cfg.light_host;
    p.prefetch           = cfg.prefetch;
    p.prefetch_max       = cfg.prefetch_max;
    return p;
}
