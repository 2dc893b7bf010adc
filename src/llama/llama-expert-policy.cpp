#include "llama-expert-policy.h"
#include "llama-expert-paths.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

//
// configuration
//

static const char * LLAMA_EXPERT_CACHE_KEYS =
    "mode, policy, rule, tau, tau_file, j, m, alpha, kmin, t, lo, hi, renorm, light, evict, admit, halve, half_life, classes, "
    "slots, ram_slots, vram, vram_reserve, ram, bypass, group, async, host, readers, direct, prefetch, profile, profile_out, "
    "stats, trace, trace_top";

const char * llama_expert_miss_rule_name(llama_expert_miss_rule rule) {
    switch (rule) {
        case LLAMA_EXPERT_MISS_FETCH_ALL:      return "fetch-all";
        case LLAMA_EXPERT_MISS_THRESHOLD:      return "threshold";
        case LLAMA_EXPERT_MISS_FIRST_CHOICE:   return "first-choice";
        case LLAMA_EXPERT_MISS_SUBSTITUTE_ALL: return "substitute-all";
        case LLAMA_EXPERT_MISS_DROP:           return "drop";
        case LLAMA_EXPERT_MISS_CACHE_ROUTE:    return "cache-route";
        case LLAMA_EXPERT_MISS_ZERO:           return "zero";
        case LLAMA_EXPERT_MISS_SER:            return "ser";
        case LLAMA_EXPERT_MISS_BAND:           return "band";
    }
    return "?";
}

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
    if (count >= 0) {
        return count;
    }
    const int32_t n = (int32_t) std::lround((double) n_expert * pct / 100.0);
    return std::max<int32_t>(1, std::min(n, n_expert));
}

static bool bad_value(std::string & err, const std::string & key, const std::string & val, const char * accepted) {
    err = "bad value '" + shown(val) + "' for key '" + shown(key) + "' (accepted: " + accepted + ")";
    return false;
}

static bool apply_preset(const std::string & val, llama_expert_cache_config & cfg, std::string & err) {
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
        return bad_value(err, "policy", val, "quality, speed, fetch-all, drop-light");
    }
    cfg.preset = val;
    return true;
}

bool llama_expert_cache_config_parse(const std::string & spec, llama_expert_cache_config & cfg, std::string & err) {
    cfg = llama_expert_cache_config();
    cfg.spec = spec;

    // split "k=v,k=v"
    std::vector<std::pair<std::string, std::string>> kv;
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
                    err = "'" + shown(item) + "' is not key=value (accepted keys: " + LLAMA_EXPERT_CACHE_KEYS + ")";
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

    if (kv.empty()) {
        return true; // empty spec: off
    }

    // defaults when a spec is given: emulate; the preset is applied before the explicit keys
    cfg.mode = LLAMA_EXPERT_CACHE_MODE_EMULATE;
    for (const auto & [key, val] : kv) {
        if (key == "policy" && !apply_preset(val, cfg, err)) {
            return false;
        }
    }

    bool explicit_rule = false;
    bool explicit_tau  = false;
    for (const auto & [key, val] : kv) {
        if (key == "policy") {
            continue;
        }
        if (key == "mode") {
            if (val == "off") {
                cfg.mode = LLAMA_EXPERT_CACHE_MODE_OFF;
            } else if (val == "emulate") {
                cfg.mode = LLAMA_EXPERT_CACHE_MODE_EMULATE;
            } else if (val == "engine") {
                cfg.mode = LLAMA_EXPERT_CACHE_MODE_ENGINE;
            } else {
                return bad_value(err, key, val, "off, emulate, engine");
            }
        } else if (key == "rule") {
            if      (val == "fetch-all")      { cfg.rule = LLAMA_EXPERT_MISS_FETCH_ALL; }
            else if (val == "threshold")      { cfg.rule = LLAMA_EXPERT_MISS_THRESHOLD; }
            else if (val == "first-choice")   { cfg.rule = LLAMA_EXPERT_MISS_FIRST_CHOICE; }
            else if (val == "substitute-all") { cfg.rule = LLAMA_EXPERT_MISS_SUBSTITUTE_ALL; }
            else if (val == "drop")           { cfg.rule = LLAMA_EXPERT_MISS_DROP; }
            else if (val == "cache-route")    { cfg.rule = LLAMA_EXPERT_MISS_CACHE_ROUTE; }
            else if (val == "zero")           { cfg.rule = LLAMA_EXPERT_MISS_ZERO; }
            else if (val == "ser")            { cfg.rule = LLAMA_EXPERT_MISS_SER; }
            else if (val == "band")           { cfg.rule = LLAMA_EXPERT_MISS_BAND; }
            else {
                return bad_value(err, key, val, "fetch-all, threshold, first-choice, substitute-all, drop, cache-route, zero, ser, band");
            }
            explicit_rule = true;
        } else if (key == "tau" || key == "tau_file") {
            float v;
            if (!parse_float(val, v) || v < 0.0f || v > 1.0f) {
                return bad_value(err, key, val, "a number in [0, 1]");
            }
            if (key == "tau") {
                cfg.tau = v;
                explicit_tau = true;
            } else {
                cfg.tau_file = v;
            }
        } else if (key == "j") {
            uint64_t v;
            if (!parse_uint(val, v) || v > 65536) {
                return bad_value(err, key, val, "a number of ranks in [0, k] always computed");
            }
            cfg.route_j = (int32_t) v;
        } else if (key == "m") {
            uint64_t v;
            if (val == "auto") {
                cfg.route_m = 0;
            } else if (parse_uint(val, v) && v >= 1 && v <= 1000000) {
                cfg.route_m = (int32_t) v;
            } else {
                return bad_value(err, key, val, "a window of router ranks in [k, n_expert], or auto (2k)");
            }
        } else if (key == "alpha") {
            float v;
            if (!parse_float(val, v) || v < 0.0f || v > 1.0f) {
                return bad_value(err, key, val, "a weight scale in [0, 1]");
            }
            cfg.route_alpha = v;
        } else if (key == "kmin") {
            uint64_t v;
            if (!parse_uint(val, v) || v < 1 || v > 65536) {
                return bad_value(err, key, val, "a number of ranks in [1, k] always computed");
            }
            cfg.ser_kmin = (int32_t) v;
        } else if (key == "t") {
            float v;
            if (!parse_float(val, v) || v < 0.0f || v > 1.0f) {
                return bad_value(err, key, val, "a ratio to the first choice's gate weight in [0, 1]");
            }
            cfg.ser_t = v;
        } else if (key == "lo" || key == "hi") {
            float v;
            if (!parse_float(val, v) || v < 0.0f || v > 1.0f) {
                return bad_value(err, key, val, key == "lo" ? "the band's lowest gate weight in [0, 1]"
                                                            : "the band's upper gate weight bound in [0, 1] (1: none)");
            }
            (key == "lo" ? cfg.band_lo : cfg.band_hi) = v;
        } else if (key == "renorm") {
            if (val == "on") {
                cfg.renorm = true;
            } else if (val == "off") {
                cfg.renorm = false;
            } else {
                return bad_value(err, key, val, "on (rescale the computed experts to the weight sum of all k) or off");
            }
        } else if (key == "light") {
            if (val == "host") {
                cfg.light_host = true;
            } else if (val == "substitute") {
                cfg.light_host = false;
            } else {
                return bad_value(err, key, val, "substitute (a resident expert computes instead) or host (the host computes the missed expert)");
            }
        } else if (key == "prefetch") {
            if (val == "on") {
                cfg.prefetch = true;
            } else if (val == "off") {
                cfg.prefetch = false;
            } else {
                return bad_value(err, key, val, "on (admit the experts the next MoE layer's router predicts, in the background) or off");
            }
        } else if (key == "evict") {
            if      (val == "lfu")      { cfg.evict = LLAMA_EXPERT_EVICT_LFU; }
            else if (val == "lru")      { cfg.evict = LLAMA_EXPERT_EVICT_LRU; }
            else if (val == "classlru") { cfg.evict = LLAMA_EXPERT_EVICT_CLASSLRU; }
            else {
                return bad_value(err, key, val, "lfu, lru, classlru");
            }
        } else if (key == "half_life") {
            uint64_t v;
            if (!parse_uint(val, v) || v < 1 || v > UINT32_MAX) {
                return bad_value(err, key, val, "a number of tokens >= 1");
            }
            cfg.classlru_half_life = (uint32_t) v;
        } else if (key == "classes") {
            uint64_t v;
            if (!parse_uint(val, v) || v < 1 || v > 32) {
                return bad_value(err, key, val, "a number of classes in [1, 32]");
            }
            cfg.classlru_classes = (uint32_t) v;
        } else if (key == "admit") {
            float v;
            if (val == "off") {
                cfg.admit = false;
            } else if (val == "on") {
                cfg.admit = true;
            } else if (parse_float(val, v) && v > 0.0f) {
                cfg.admit = true;
                cfg.beta  = v;
            } else {
                return bad_value(err, key, val, "off, on, or a threshold beta > 0");
            }
        } else if (key == "halve") {
            uint64_t v;
            if (!parse_uint(val, v) || v > UINT32_MAX) {
                return bad_value(err, key, val, "a number of tokens, 0 for never");
            }
            cfg.lfu_halve = (uint32_t) v;
        } else if (key == "slots" || key == "ram_slots") {
            // the slots' residency, or (ram_slots) the RAM tier's (three tiers: slots <- RAM tier <- model file)
            const bool ram = key == "ram_slots";
            if (!parse_residency(val, ram ? cfg.ram_slots_count : cfg.slots_count, ram ? cfg.ram_slots_pct : cfg.slots_pct)) {
                return bad_value(err, key, val, ram ? "a count of experts per layer, or a percentage in (0, 100] such as 50%"
                                                    : "a count of experts per layer, or a percentage in (0, 100] such as 25%");
            }
        } else if (key == "ram") {
            uint64_t v;
            if (!parse_size(val, v) || v == 0) {
                return bad_value(err, key, val, "a size such as 8G or 8GiB (binary), 8GB (decimal), 512M or a number of bytes");
            }
            cfg.ram = v;
        } else if (key == "vram" || key == "vram_reserve") {
            uint64_t v;
            if (!parse_size(val, v) || (key == "vram" && v == 0)) {
                return bad_value(err, key, val, "a size such as 24G or 24GiB (binary), 24GB (decimal), 512M or a number of bytes");
            }
            (key == "vram" ? cfg.vram : cfg.vram_reserve) = v;
        } else if (key == "bypass") {
            uint64_t v;
            if (!parse_uint(val, v) || v == 1 || v > INT32_MAX) {
                return bad_value(err, key, val, "a ubatch size of at least 2 tokens, 0 for never");
            }
            cfg.bypass = (uint32_t) v;
        } else if (key == "group") {
            uint64_t v;
            if (val == "auto") {
                cfg.group = -1;
            } else if (parse_uint(val, v) && v <= 65536) {
                cfg.group = (int32_t) v;
            } else {
                return bad_value(err, key, val, "a ubatch size in tokens (0 or 1: one-token ubatches only), or auto");
            }
        } else if (key == "async") {
            if (val == "auto") {
                cfg.async = LLAMA_EXPERT_ASYNC_AUTO;
            } else if (val == "off") {
                cfg.async = LLAMA_EXPERT_ASYNC_OFF;
            } else if (val == "thread") {
                cfg.async = LLAMA_EXPERT_ASYNC_THREAD;
            } else {
                return bad_value(err, key, val, "auto (a copy stream on GPUs), off (synchronous copies) or thread (a host copy thread, for RAM banks)");
            }
        } else if (key == "host") {
            if (val == "ram") {
                cfg.host_file = false;
            } else if (val == "file") {
                cfg.host_file = true;
            } else {
                return bad_value(err, key, val, "ram (copy missed experts from the expert tensors in memory) or file (read them from the model file)");
            }
        } else if (key == "readers") {
            uint64_t v;
            if (!parse_uint(val, v) || v < 1 || v > 64) {
                return bad_value(err, key, val, "a number of reader threads, 1 to 64");
            }
            cfg.readers = (int32_t) v;
        } else if (key == "direct") {
            if (val == "auto") {
                cfg.direct = LLAMA_EXPERT_DIRECT_AUTO;
            } else if (val == "on") {
                cfg.direct = LLAMA_EXPERT_DIRECT_ON;
            } else if (val == "off") {
                cfg.direct = LLAMA_EXPERT_DIRECT_OFF;
            } else {
                return bad_value(err, key, val, "auto (O_DIRECT reads where the file system allows them, else buffered), on (O_DIRECT or an error) or off (buffered reads)");
            }
        } else if (key == "profile" || key == "profile_out" || key == "stats" || key == "trace") {
            if (val.empty()) {
                return bad_value(err, key, val, "a file path");
            }
            if (!llama_expert_path_check(key + "=", val, err)) { return false; } // a FIFO would block open()
            if (key == "profile")     { cfg.profile     = val; }
            if (key == "profile_out") { cfg.profile_out = val; }
            if (key == "stats")       { cfg.stats       = val; }
            if (key == "trace")       { cfg.trace       = val; }
        } else if (key == "trace_top") {
            uint64_t v;
            if (!parse_uint(val, v) || v > 65536) {
                return bad_value(err, key, val, "a count of router probabilities per token and layer");
            }
            cfg.trace_top = (uint32_t) v;
        } else {
            err = "unknown key '" + shown(key) + "' (accepted keys: " + LLAMA_EXPERT_CACHE_KEYS + ")";
            return false;
        }
    }
    if (explicit_rule) {
        cfg.preset = "custom";
    }
    if (cfg.rule == LLAMA_EXPERT_MISS_ZERO && !explicit_tau && cfg.preset != "drop-light") {
        cfg.tau = 0.03f; // colibri DEGRADE_ZERO's default (policy=drop-light: its own 0.2)
    }
    const llama_expert_miss_rule rule = cfg.rule;
    const bool rule_drops      = rule == LLAMA_EXPERT_MISS_DROP || rule == LLAMA_EXPERT_MISS_ZERO || rule == LLAMA_EXPERT_MISS_SER;
    const bool rule_substitutes = rule == LLAMA_EXPERT_MISS_THRESHOLD || rule == LLAMA_EXPERT_MISS_FIRST_CHOICE ||
        rule == LLAMA_EXPERT_MISS_SUBSTITUTE_ALL || rule == LLAMA_EXPERT_MISS_CACHE_ROUTE || rule == LLAMA_EXPERT_MISS_BAND;
    if (rule == LLAMA_EXPERT_MISS_BAND && !(cfg.band_lo < cfg.band_hi)) {
        err = "rule=band substitutes the misses with gate weight in [lo, hi): lo (" + std::to_string(cfg.band_lo) +
            ") must be below hi (" + std::to_string(cfg.band_hi) + ")";
        return false;
    }
    for (const auto & [key, val] : kv) {
        if (key == "tau_file" && rule != LLAMA_EXPERT_MISS_THRESHOLD) {
            err = std::string("tau_file applies to rule=threshold (policy=quality), not to rule=") +
                llama_expert_miss_rule_name(rule) + ": remove tau_file, or use rule=threshold";
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
        if (key == "tau" && rule != LLAMA_EXPERT_MISS_THRESHOLD && rule != LLAMA_EXPERT_MISS_ZERO) {
            err = std::string("tau applies to rule=threshold (policy=quality) or rule=zero, not to rule=") +
                llama_expert_miss_rule_name(rule) + ": remove tau, or use rule=threshold";
            return false;
        }
        if ((key == "j" || key == "m" || key == "alpha") && rule != LLAMA_EXPERT_MISS_CACHE_ROUTE) {
            err = key + " applies to rule=cache-route, not to rule=" + llama_expert_miss_rule_name(rule) + ": remove " + key +
                ", or use rule=cache-route";
            return false;
        }
        if ((key == "m" || key == "alpha") && cfg.light_host) {
            err = key + " chooses and weighs substitutes, and light=host computes every light miss on the host: remove " +
                key + ", or use light=substitute";
            return false;
        }
        if ((key == "kmin" || key == "t") && rule != LLAMA_EXPERT_MISS_SER) {
            err = key + " applies to rule=ser, not to rule=" + llama_expert_miss_rule_name(rule) + ": remove " + key +
                ", or use rule=ser";
            return false;
        }
        if ((key == "lo" || key == "hi") && rule != LLAMA_EXPERT_MISS_BAND) {
            err = key + " applies to rule=band, not to rule=" + llama_expert_miss_rule_name(rule) + ": remove " + key +
                ", or use rule=band";
            return false;
        }
        if (key == "renorm" && !rule_drops) {
            err = std::string("renorm applies to the rules that drop (drop, zero, ser), not to rule=") +
                llama_expert_miss_rule_name(rule) + ": remove renorm";
            return false;
        }
        if (key == "light" && !rule_substitutes) {
            err = std::string("light applies to the rules that substitute (threshold, first-choice, substitute-all, "
                "cache-route, band), not to rule=") + llama_expert_miss_rule_name(rule) + ": remove light";
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
    if (cfg.ram > 0 && cfg.vram > 0) {
        err = "ram= and vram= are two budgets for the same banks: give one (vram= where the banks are on a GPU)";
        return false;
    }
    if (cfg.ram > 0 && !cfg.host_file) {
        err = "ram= budgets RAM with the experts left in the model file: it needs host=file";
        return false;
    }
    for (const char * k : { "readers", "direct" }) {
        const bool given = std::any_of(kv.begin(), kv.end(), [k](const auto & p) { return p.first == k; });
        if (given && !cfg.host_file && cfg.mode != LLAMA_EXPERT_CACHE_MODE_OFF) {
            err = std::string(k) + "= sets how host=file reads experts from the model file: it needs host=file";
            return false;
        }
    }
    if (cfg.host_file && cfg.mode == LLAMA_EXPERT_CACHE_MODE_EMULATE) {
        // emulate simulates the tiers: misses come from the file (tau_file), nothing is read
        for (const auto & [key, val] : kv) {
            if (key == "readers" || key == "direct") {
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
    if (cfg.light_host && cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE) {
        err = "light=host (experts computed on the host) is not implemented in mode=engine yet: use mode=emulate, or light=substitute";
        return false;
    }
    return true;
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
    switch (cfg.rule) {
        case LLAMA_EXPERT_MISS_DROP:
        case LLAMA_EXPERT_MISS_ZERO:
        case LLAMA_EXPERT_MISS_SER:
            return true;
        case LLAMA_EXPERT_MISS_CACHE_ROUTE:
            return cfg.route_alpha != 1.0f;
        default:
            return false;
    }
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

//
// statistics
//

void llama_expert_policy_stats::add(const llama_expert_policy_stats & o) {
#define LLAMA_EXPERT_COUNTER_ADD(field, metric, help) field += o.field;
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_ADD)
#undef LLAMA_EXPERT_COUNTER_ADD
    subst_mass_sum          += o.subst_mass_sum;
    drop_mass_sum           += o.drop_mass_sum;
    max_subst_weight         = std::max(max_subst_weight, o.max_subst_weight);
    for (int i = 0; i < LLAMA_EXPERT_MASS_HIST_BINS; ++i) {
        mass_hist[i] += o.mass_hist[i];
    }
}

//
// layer policy
//

void llama_expert_layer_policy::init(int32_t n_expert_, int32_t n_slots_, const llama_expert_cache_config & cfg) {
    n_expert  = n_expert_;
    n_slots   = std::min(n_slots_, n_expert_);
    rule      = cfg.rule;
    // the threshold of the tier the misses come from: the model file (host=file) or memory; with a RAM tier,
    // tau_ram for the misses it holds
    tau       = cfg.host_file && cfg.tau_file >= 0.0f ? cfg.tau_file : cfg.tau;
    tau_ram   = cfg.tau;
    n_ram     = std::min(llama_expert_cache_config_n_ram_slots(cfg, n_expert_), n_expert_);
    evict     = cfg.evict;
    admit     = cfg.admit;
    beta      = cfg.beta;
    lfu_halve = cfg.lfu_halve;
    classlru_half_life = cfg.classlru_half_life;
    classlru_classes   = cfg.classlru_classes;
    route_j     = cfg.route_j;
    route_m     = cfg.route_m;
    route_alpha = cfg.route_alpha;
    ser_kmin    = cfg.ser_kmin;
    ser_t       = cfg.ser_t;
    band_lo     = cfg.band_lo;
    band_hi     = cfg.band_hi;
    renorm      = cfg.renorm;
    light_host  = cfg.light_host;
    prefetch    = cfg.prefetch;

    initial.resize(n_slots);
    for (int32_t s = 0; s < n_slots; ++s) {
        initial[s] = s;
    }
    reset();
}

void llama_expert_layer_policy::set_initial(const std::vector<uint64_t> * counts) {
    std::vector<int32_t> order(n_expert);
    for (int32_t e = 0; e < n_expert; ++e) {
        order[e] = e;
    }
    if (counts && (int32_t) counts->size() == n_expert) {
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return (*counts)[a] > (*counts)[b];
        });
    }
    initial.assign(order.begin(), order.begin() + n_slots);
    reset();
}

void llama_expert_layer_policy::reset() {
    slot_of.assign(n_expert, -1);
    expert_of.assign(n_slots, -1);
    use_count.assign(n_expert, 0);
    last_use.assign(n_expert, 0);
    admit_acc.assign(n_expert, 0.0);
    sel_total.assign(n_expert, 0);
    decay_count.assign(n_expert, 0.0);
    decay_tick.assign(n_expert, 0);
    sel_mark.assign(n_expert, 0);
    sub_mark.assign(n_expert, 0);
    hold_mark.assign(n_expert, 0);
    group    = 0;
    in_group = false;
    cand.clear();
    cand_tick = 0;
    window.clear();
    window_tick = 0;
    pending.clear();
    pf_unused.assign(n_expert, 0);
    pf_mark.assign(n_expert, 0);
    pf_tick     = 0;
    in_prefetch = false;
    tick  = 0;
    stats = llama_expert_policy_stats();
    ram_of.assign(n_ram > 0 ? n_expert : 0, -1);
    ram_expert.assign(n_ram, -1);
    ram_last.assign(n_ram > 0 ? n_expert : 0, 0);
    for (int32_t s = 0; s < (int32_t) initial.size(); ++s) {
        place(initial[s], s);
        if (s < n_ram) { // the RAM tier holds the initial residency too (it is filled from the file through it)
            ram_expert[s]         = initial[s];
            ram_of[initial[s]]    = s;
        }
    }
}

void llama_expert_layer_policy::ram_touch(int32_t e) {
    if (n_ram > 0 && ram_of[e] >= 0) {
        ram_last[e] = tick;
    }
}

void llama_expert_layer_policy::ram_load(int32_t e) {
    if (n_ram == 0) {
        return;
    }
    if (ram_of[e] >= 0) {
        stats.ram_tier_loads++;
        ram_last[e] = tick;
        return;
    }
    stats.file_loads++;
    // into the RAM tier on its way: a free RAM slot, else the least recently used expert not used or loaded by
    // this token (ties: lowest id); none (every RAM slot used by this token): the expert is not kept in RAM
    int32_t slot = -1, victim = -1;
    for (int32_t s = 0; s < n_ram; ++s) {
        const int32_t x = ram_expert[s];
        if (x < 0) {
            slot = s;
            break;
        }
        if (ram_last[x] == tick || sel_mark[x] == tick || sub_mark[x] == tick || (in_group && hold_mark[x] == group)) {
            continue;
        }
        if (victim < 0 || ram_last[x] < ram_last[victim] || (ram_last[x] == ram_last[victim] && x < victim)) {
            victim = x;
        }
    }
    if (slot < 0 && victim >= 0) {
        slot = ram_of[victim];
        ram_of[victim] = -1;
    }
    if (slot >= 0) {
        ram_expert[slot] = e;
        ram_of[e]        = slot;
        ram_last[e]      = tick;
    }
}

int32_t llama_expert_layer_policy::n_resident() const {
    int32_t n = 0;
    for (int32_t e : expert_of) {
        n += e >= 0;
    }
    return n;
}

void llama_expert_layer_policy::place(int32_t e, int32_t slot) {
    const int32_t old = expert_of[slot];
    if (old >= 0) {
        slot_of[old] = -1;
        if (pf_unused[old]) {
            pf_unused[old] = 0;
            stats.prefetch_wasted++;
        }
    }
    expert_of[slot] = e;
    slot_of[e]      = slot;
    admit_acc[e]    = 0.0;
    pf_unused[e]    = 0;
}

bool llama_expert_layer_policy::busy(int32_t e) const {
    if (in_group && hold_mark[e] == group) {
        return true; // computed with by a token of the current group
    }
    if (in_prefetch) {
        return pf_mark[e] == pf_tick; // another expert of the prediction being applied (between two tokens)
    }
    return sel_mark[e] == tick || sub_mark[e] == tick; // selected by, or a substitute of, the token being decided
}

int32_t llama_expert_layer_policy::prefetch_experts(const int32_t * ids, int32_t n) {
    ++pf_tick;
    for (int32_t r = 0; r < n; ++r) {
        if (ids[r] >= 0 && ids[r] < n_expert) {
            pf_mark[ids[r]] = pf_tick;
        }
    }
    in_prefetch = true;
    int32_t added = 0;
    for (int32_t r = 0; r < n; ++r) {
        const int32_t e = ids[r];
        if (e < 0 || e >= n_expert || slot_of[e] >= 0) {
            continue;
        }
        const int32_t slot = find_slot();
        if (slot < 0) {
            break; // every slot is held by the group or by this prediction
        }
        place(e, slot);
        ram_load(e);
        last_use[e]  = tick;
        pf_unused[e] = 1;
        stats.prefetches++;
        ++added;
    }
    in_prefetch = false;
    return added;
}

double llama_expert_layer_policy::classlru_count(int32_t e) const {
    // exact exponential decay, applied lazily: the count as of decay_tick, halved every half_life ticks since
    return decay_count[e] * std::exp2(-(double) (tick - decay_tick[e]) / (double) classlru_half_life);
}

int32_t llama_expert_layer_policy::classlru_class(int32_t e) const {
    const double c = classlru_count(e);
    if (!(c >= 2.0)) {
        return 0; // floor(log2(c)) <= 0
    }
    int ex = 0;
    std::frexp(c, &ex); // c = f * 2^ex, f in [0.5, 1): floor(log2(c)) = ex - 1, exactly
    return std::min<int32_t>(ex - 1, (int32_t) classlru_classes - 1);
}

void llama_expert_layer_policy::count_use(int32_t e, double n) {
    if (n == 0.0) {
        return;
    }
    use_count[e] += (uint32_t) n;
    if (evict == LLAMA_EXPERT_EVICT_CLASSLRU) {
        decay_count[e] = classlru_count(e) + n;
        decay_tick[e]  = tick;
    }
}

int32_t llama_expert_layer_policy::find_slot() {
    int32_t best    = -1;
    int32_t best_e  = -1;
    if (evict == LLAMA_EXPERT_EVICT_CLASSLRU) {
        // ClassLRU: the least recently used evictable expert of each class (ties: lowest id), then among those
        // the largest age / 2^class (ties: the lower class)
        int32_t head[32];
        std::fill(head, head + 32, -1);
        for (int32_t s = 0; s < n_slots; ++s) {
            const int32_t e = expert_of[s];
            if (e < 0) {
                return s;
            }
            if (busy(e)) {
                continue;
            }
            const int32_t c = classlru_class(e);
            const int32_t h = head[c];
            if (h < 0 || last_use[e] < last_use[h] || (last_use[e] == last_use[h] && e < h)) {
                head[c] = e;
            }
        }
        double best_key = -1.0;
        for (int32_t c = 0; c < (int32_t) classlru_classes; ++c) {
            const int32_t e = head[c];
            if (e < 0) {
                continue;
            }
            const double key = std::ldexp((double) (tick - last_use[e]), -c);
            if (key > best_key) {
                best_key = key;
                best_e   = e;
            }
        }
        if (best_e < 0) {
            return -1;
        }
        stats.evictions++;
        return slot_of[best_e];
    }
    for (int32_t s = 0; s < n_slots; ++s) {
        const int32_t e = expert_of[s];
        if (e < 0) {
            return s;
        }
        // never evict an expert used by the token being decided, or by an earlier token of the group
        if (busy(e)) {
            continue;
        }
        if (best < 0) {
            best = s; best_e = e;
            continue;
        }
        bool better;
        if (evict == LLAMA_EXPERT_EVICT_LFU) {
            // least frequently used; ties: least recently used, then lowest id
            better = use_count[e] < use_count[best_e] ||
                (use_count[e] == use_count[best_e] && (last_use[e] < last_use[best_e] ||
                    (last_use[e] == last_use[best_e] && e < best_e)));
        } else {
            // least recently used; ties: lowest id
            better = last_use[e] < last_use[best_e] || (last_use[e] == last_use[best_e] && e < best_e);
        }
        if (better) {
            best = s; best_e = e;
        }
    }
    if (best >= 0) {
        stats.evictions++;
    }
    return best;
}

int32_t llama_expert_layer_policy::find_substitute(const float * scores, bool allow_reuse) {
    // Fast path: on the first substitution of a token, keep the best-scored resident experts that the token
    // did not select, in order (score descending, then id ascending). Within the token no expert joins that
    // set (a fetch loads a selected expert; admissions happen at the end of the token), experts only leave it
    // (evicted, or used as a substitute), so the first one still valid is the argmax of the full scan below.
    // When none of them is valid any more, fall back to the full scan.
    const auto better = [scores](int32_t a, int32_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    };
    if (!allow_reuse && fast_substitute) {
        if (cand_tick != tick) {
            // insertion into a short sorted array of (score, id); most experts fail the first comparison
            const int32_t cap = 8;
            float   cs[cap];
            int32_t ce[cap];
            int32_t n = 0;
            for (int32_t s = 0; s < n_slots; ++s) {
                const int32_t e = expert_of[s];
                if (e < 0 || sel_mark[e] == tick) {
                    continue;
                }
                const float v = scores[e];
                if (n == cap && !(v > cs[cap - 1] || (v == cs[cap - 1] && e < ce[cap - 1]))) {
                    continue;
                }
                int32_t i = n < cap ? n++ : cap - 1;
                while (i > 0 && (v > cs[i - 1] || (v == cs[i - 1] && e < ce[i - 1]))) {
                    cs[i] = cs[i - 1];
                    ce[i] = ce[i - 1];
                    --i;
                }
                cs[i] = v;
                ce[i] = e;
            }
            cand.assign(ce, ce + n);
            cand_tick = tick;
        }
        for (int32_t e : cand) {
            if (slot_of[e] >= 0 && sub_mark[e] != tick) {
                return e;
            }
        }
    }

    int32_t best = -1;
    for (int32_t s = 0; s < n_slots; ++s) {
        const int32_t e = expert_of[s];
        if (e < 0 || sel_mark[e] == tick || (!allow_reuse && sub_mark[e] == tick)) {
            continue;
        }
        if (best < 0 || better(e, best)) {
            best = e;
        }
    }
    return best;
}

int32_t llama_expert_layer_policy::find_route_substitute(const float * scores, int32_t k) {
    // the router's top m of this token (score descending, ties: lowest id), built on the first need
    if (window_tick != tick) {
        const int32_t m = std::min(n_expert, route_m > 0 ? route_m : 2*k);
        window.resize(n_expert);
        for (int32_t e = 0; e < n_expert; ++e) {
            window[e] = e;
        }
        std::partial_sort(window.begin(), window.begin() + m, window.end(), [scores](int32_t a, int32_t b) {
            return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
        });
        window.resize(m);
        window_tick = tick;
    }
    // the best of them that is resident, not selected by the token and not yet one of its substitutes
    for (int32_t e : window) {
        if (slot_of[e] >= 0 && sel_mark[e] != tick && sub_mark[e] != tick) {
            return e;
        }
    }
    return -1;
}

void llama_expert_layer_policy::begin_group() {
    ++group;
    in_group = true;
}

void llama_expert_layer_policy::end_group() {
    in_group = false;
}

void llama_expert_layer_policy::decide(const int32_t * ids, const float * w, int32_t k, const float * scores,
                                       int32_t * out_ids, uint8_t * out_actions, float * out_scale) {
    ++tick;
    for (int32_t r = 0; r < k; ++r) {
        sel_mark[ids[r]] = tick;
    }

    double mass      = 0.0;
    double drop_mass = 0.0;

    for (int32_t r = 0; r < k; ++r) {
        const int32_t e = ids[r];
        stats.calls++;
        count_use(e, 1.0);
        sel_total[e]++;
        if (out_scale) {
            out_scale[r] = 1.0f;
        }

        // SER (cache-unaware): a rank after the first kmin runs only if its weight is > t * the first choice's
        if (rule == LLAMA_EXPERT_MISS_SER && r >= ser_kmin && !(w[r] > ser_t * w[0])) {
            stats.skips++;
            drop_mass     += w[r];
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_DROP;
            continue;
        }

        if (slot_of[e] >= 0) {
            stats.hits++;
            if (pf_unused[e]) {
                pf_unused[e] = 0;
                stats.prefetch_used++;
            }
            last_use[e]    = tick;
            ram_touch(e);
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_HIT;
            continue;
        }

        stats.misses++;

        if (rule == LLAMA_EXPERT_MISS_DROP || (rule == LLAMA_EXPERT_MISS_ZERO && w[r] < tau)) {
            stats.drops++;
            drop_mass     += w[r];
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_DROP;
            continue;
        }

        bool want_fetch = false;
        switch (rule) {
            case LLAMA_EXPERT_MISS_FETCH_ALL:      want_fetch = true; break;
            case LLAMA_EXPERT_MISS_THRESHOLD:      want_fetch = r == 0 || w[r] >= (in_ram(e) ? tau_ram : tau); break;
            case LLAMA_EXPERT_MISS_FIRST_CHOICE:   want_fetch = r == 0; break;
            case LLAMA_EXPERT_MISS_SUBSTITUTE_ALL: want_fetch = false; break;
            case LLAMA_EXPERT_MISS_CACHE_ROUTE:    want_fetch = r < route_j; break;
            case LLAMA_EXPERT_MISS_ZERO:           want_fetch = true; break;
            case LLAMA_EXPERT_MISS_SER:            want_fetch = true; break;
            case LLAMA_EXPERT_MISS_BAND:           want_fetch = !(w[r] >= band_lo && (w[r] < band_hi || band_hi >= 1.0f)); break;
            case LLAMA_EXPERT_MISS_DROP:           break;
        }

        if (!want_fetch && light_host) {
            // a light miss computed on the host with the missed expert itself: exact, the residency is unchanged
            stats.host_computes++;
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_HOST;
            if (admit) {
                admit_acc[e] += w[r];
                if (admit_acc[e] >= beta) {
                    pending.push_back(e);
                }
            }
            continue;
        }

        int32_t sub = -1;
        if (!want_fetch) {
            sub = rule == LLAMA_EXPERT_MISS_CACHE_ROUTE ? find_route_substitute(scores, k) : find_substitute(scores, false);
            // no resident expert available (cache-route: none within the router's top m): fetch
        }
        if (sub < 0) {
            const int32_t slot = find_slot();
            if (slot >= 0) {
                place(e, slot);
                ram_load(e);
                stats.fetches++;
                last_use[e]    = tick;
                out_ids[r]     = e;
                out_actions[r] = LLAMA_EXPERT_ACTION_FETCH;
                continue;
            }
            // every slot is in use by this token (only possible when n_slots is close to k):
            // substitute, reusing a substitute of this token if needed
            sub = find_substitute(scores, false);
            if (sub < 0) {
                sub = find_substitute(scores, true);
            }
            stats.forced_substitutions++;
        }
        if (sub < 0) {
            // only possible with n_slots < k, which the configuration refuses: drop
            stats.drops++;
            drop_mass     += w[r];
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_DROP;
            continue;
        }
        // substitute: the resident expert computes with the missed expert's gate weight (cache-route: times alpha)
        stats.substitutions++;
        if (r == 0) {
            stats.subst_first_choice++;
        }
        stats.max_subst_weight = std::max(stats.max_subst_weight, w[r]);
        mass += w[r];
        sub_mark[sub]  = tick;
        last_use[sub]  = tick;
        if (pf_unused[sub]) {
            pf_unused[sub] = 0;
            stats.prefetch_used++;
        }
        ram_touch(sub);
        out_ids[r]     = sub;
        out_actions[r] = LLAMA_EXPERT_ACTION_SUBSTITUTE;
        if (out_scale && rule == LLAMA_EXPERT_MISS_CACHE_ROUTE) {
            out_scale[r] = route_alpha;
        }

        if (admit) {
            admit_acc[e] += w[r];
            if (admit_acc[e] >= beta) {
                pending.push_back(e);
            }
        }
    }

    // a drop or a skip computes with gate weight 0
    if (out_scale) {
        for (int32_t r = 0; r < k; ++r) {
            if (out_actions[r] == LLAMA_EXPERT_ACTION_DROP) {
                out_scale[r] = 0.0f;
            }
        }
    }

    // renorm=on: the computed selections take the weight of all k (their weights times sum / kept sum)
    if (renorm && out_scale) {
        double sum = 0.0, kept = 0.0;
        for (int32_t r = 0; r < k; ++r) {
            sum += w[r];
            if (out_actions[r] != LLAMA_EXPERT_ACTION_DROP) {
                kept += w[r];
            }
        }
        if (kept > 0.0 && kept < sum) {
            const float f = (float) (sum / kept);
            for (int32_t r = 0; r < k; ++r) {
                if (out_actions[r] != LLAMA_EXPERT_ACTION_DROP) {
                    out_scale[r] *= f;
                }
            }
        }
    }

    if (in_group) {
        // the experts this token computes with stay resident until the group ends
        for (int32_t r = 0; r < k; ++r) {
            if (out_actions[r] != LLAMA_EXPERT_ACTION_DROP && out_actions[r] != LLAMA_EXPERT_ACTION_HOST) {
                hold_mark[out_ids[r]] = group;
            }
        }
    }

    // background admission: the copy completes before the next token of this layer
    for (int32_t e : pending) {
        if (slot_of[e] >= 0) {
            continue;
        }
        const int32_t slot = find_slot();
        if (slot < 0) {
            continue; // every slot in use by this token; the accumulator is kept, retried on the next substitution
        }
        place(e, slot);
        ram_load(e);
        last_use[e] = tick;
        stats.admissions++;
    }
    pending.clear();

    stats.token_layers++;
    if (mass > 0.0) {
        stats.token_layers_with_subst++;
    }
    stats.subst_mass_sum += mass;
    stats.drop_mass_sum  += drop_mass;
    int bin = (int) (mass * LLAMA_EXPERT_MASS_HIST_BINS);
    bin = std::max(0, std::min(bin, LLAMA_EXPERT_MASS_HIST_BINS - 1));
    stats.mass_hist[bin]++;

    // LFU aging
    if (evict == LLAMA_EXPERT_EVICT_LFU && lfu_halve > 0 && tick % lfu_halve == 0) {
        for (auto & c : use_count) {
            c >>= 1;
        }
    }
}

//
// profiles
//

bool llama_expert_profile_read(const std::string & path, std::vector<std::vector<uint64_t>> & counts, std::string & err) {
    std::ifstream f(path);
    if (!f) {
        err = "cannot open profile '" + path + "'";
        return false;
    }
    std::string line;
    if (!std::getline(f, line) || line.rfind("moe-expert-profile 1", 0) != 0) {
        err = "profile '" + path + "' does not start with 'moe-expert-profile 1'";
        return false;
    }
    counts.clear();
    while (std::getline(f, line)) {
        if (line.empty() || line[0] == '#') {
            continue;
        }
        std::istringstream ss(line);
        std::string tag;
        int64_t il = -1, n = -1;
        if (!(ss >> tag >> il >> n) || tag != "layer" || il < 0 || il > 100000 || n <= 0 || n > 1000000) {
            err = "profile '" + path + "': bad line '" + line.substr(0, 60) + "'";
            return false;
        }
        if ((int64_t) counts.size() <= il) {
            counts.resize(il + 1);
        }
        auto & c = counts[il];
        c.resize(n);
        for (int64_t i = 0; i < n; ++i) {
            if (!(ss >> c[i])) {
                err = "profile '" + path + "': layer " + std::to_string(il) + " has fewer than " + std::to_string(n) + " counts";
                return false;
            }
        }
    }
    return true;
}

bool llama_expert_profile_write(const std::string & path, const std::vector<const llama_expert_layer_policy *> & layers,
                                const std::vector<int32_t> & layer_ids) {
    FILE * f = std::fopen(path.c_str(), "w");
    if (!f) {
        return false;
    }
    std::fprintf(f, "moe-expert-profile 1\n");
    for (size_t i = 0; i < layers.size(); ++i) {
        const auto * lp = layers[i];
        std::fprintf(f, "layer %d %d", layer_ids[i], lp->n_expert);
        for (uint64_t c : lp->sel_total) {
            std::fprintf(f, " %llu", (unsigned long long) c);
        }
        std::fprintf(f, "\n");
    }
    const bool ok = !std::ferror(f);
    return std::fclose(f) == 0 && ok;
}

//
// prefill bypass
//

// an invariant of the policy (the policy compiles without ggml, for its unit tests and llama-moe-sim)
static void policy_check(bool ok, const char * what) {
    if (!ok) {
        fprintf(stderr, "expert policy: invariant violated: %s\n", what);
        abort();
    }
}

void llama_expert_policy_warm(llama_expert_layer_policy & p, const std::vector<uint32_t> & counts) {
    const int32_t E = p.n_expert;
    policy_check((int32_t) counts.size() == E, "one count per expert");

    std::vector<int32_t> order(E);
    for (int32_t e = 0; e < E; ++e) {
        order[e] = e;
        p.count_use(e, (double) counts[e]);
        p.sel_total[e] += counts[e];
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return counts[a] > counts[b]; });

    std::vector<bool> want(E, false);
    int32_t n_want = 0;
    for (int32_t e : order) {
        if (n_want == p.n_slots || counts[e] == 0) {
            break;
        }
        want[e] = true;
        ++n_want;
    }

    // victims: slots whose expert is not wanted, empty first, then lowest count, then least recently used
    std::vector<int32_t> victims;
    for (int32_t s = 0; s < p.n_slots; ++s) {
        const int32_t e = p.expert_of[s];
        if (e < 0 || !want[e]) {
            victims.push_back(s);
        }
    }
    std::stable_sort(victims.begin(), victims.end(), [&](int32_t a, int32_t b) {
        const int32_t ea = p.expert_of[a], eb = p.expert_of[b];
        if ((ea < 0) != (eb < 0)) {
            return ea < 0;
        }
        if (ea < 0) {
            return false;
        }
        if (counts[ea] != counts[eb]) {
            return counts[ea] < counts[eb];
        }
        return p.last_use[ea] < p.last_use[eb];
    });

    size_t iv = 0;
    for (int32_t e : order) {
        if (!want[e]) {
            break;
        }
        if (p.slot_of[e] >= 0) {
            p.last_use[e] = p.tick;
            continue;
        }
        policy_check(iv < victims.size(), "a victim slot for every wanted expert");
        const int32_t s   = victims[iv++];
        const int32_t old = p.expert_of[s];
        if (old >= 0) {
            p.slot_of[old] = -1;
            if (p.pf_unused[old]) {
                p.pf_unused[old] = 0;
                p.stats.prefetch_wasted++;
            }
        }
        p.expert_of[s]  = e;
        p.slot_of[e]    = s;
        p.admit_acc[e]  = 0.0;
        p.last_use[e]   = p.tick;
    }
}
