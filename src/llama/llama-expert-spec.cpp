#include "llama-expert-spec.h"

#include "llama-expert-budget.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

//
// configuration
//

static const char * LLAMA_EXPERT_CACHE_KEYS =
    "mode, policy, rule, tau, tau_file, j, m, alpha, kmin, t, lo, hi, renorm, light, evict, admit, halve, half_life, classes, "
    "slots, ram_slots, vram, vram_reserve, ram, bypass, group, async, host, readers, direct, prefetch, profile, profile_out, "
    "stats, trace, trace_top";

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
