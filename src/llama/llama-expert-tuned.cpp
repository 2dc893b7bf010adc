#include "llama-expert-tuned.h"

#include "llama-expert-json.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <sys/stat.h>

// the keys every `model`, `machine` and `choices[]` entry has (the fields of harness.domain.tune.ModelIdentity,
// MachineFacts and TuneChoice, in their order; tests/test_tuned.py removes each in turn and checks that both readers
// name it)
static const char * const TUNED_MODEL_KEYS[] = {
    "name", "file_name", "file_bytes", "fingerprint", "n_expert", "n_expert_used", "n_moe_layers",
};
// (MachineFacts' fields but gpus, which the Python reader takes as empty when absent; the reader uses none of them)
static const char * const TUNED_MACHINE_KEYS[] = {
    "cpus", "mem_total", "mem_available", "disk_path", "disk_expert_bytes", "disk_read_bytes", "disk_readers",
    "disk_direct", "disk_expert_us", "disk_gbs", "host_copy_gbs", "compute_ms_per_token",
};
static const char * const TUNED_CHOICE_KEYS[] = {
    "residency", "fraction", "slots", "n_expert", "policy", "spec", "delta_pct", "ci_low", "ci_high",
    "est_tokens_per_s", "est_fetch_all_tokens_per_s", "est_quality_tokens_per_s", "measured_tokens_per_s",
};

// the largest profile read (harness tune writes a few KiB)
static const uint64_t TUNED_MAX_BYTES = 16u << 20;

static std::string tuned_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

// a JSON value as Python's repr() writes the value json.loads gives (for messages; an object abbreviated)
static std::string tuned_repr(const llama_expert_json * v) {
    if (v == nullptr || v->kind == llama_expert_json::NUL) {
        return "None";
    }
    switch (v->kind) {
        case llama_expert_json::BOOL:   return v->boolean ? "True" : "False";
        case llama_expert_json::STRING: return "'" + v->str + "'";
        case llama_expert_json::OBJECT: return "{...}"; // (its members' order is not kept)
        case llama_expert_json::ARRAY: {
            std::string s;
            for (const auto & item : v->items) {
                s += (s.empty() ? "" : ", ") + tuned_repr(&item);
            }
            return "[" + s + "]";
        }
        default: break;
    }
    if (v->integer) {
        return tuned_format("%.0f", v->number);
    }
    // the shortest text that reads back as the same double, with ".0" when it looks like an integer (Python's repr)
    std::string s;
    for (int prec = 1; prec <= 17; ++prec) {
        s = tuned_format("%.*g", prec, v->number);
        if (std::strtod(s.c_str(), nullptr) == v->number) {
            break;
        }
    }
    if (s.find_first_of(".en") == std::string::npos) {
        s += ".0";
    }
    return s;
}

// Python's str(): a string as it is, anything else as repr
static std::string tuned_str(const llama_expert_json * v) {
    return v != nullptr && v->kind == llama_expert_json::STRING ? v->str : tuned_repr(v);
}

// harness.domain.tune._num: a finite number (not a bool)
static bool tuned_num(const llama_expert_json * v, const std::string & what, double & out, std::string & err) {
    if (v == nullptr || v->kind != llama_expert_json::NUMBER) {
        err = what + " is " + tuned_repr(v) + ", not a finite number";
        return false;
    }
    out = v->number;
    return true;
}

// harness.domain.tune._build: an object with every one of `keys`
template <size_t N>
static bool tuned_has_all(const llama_expert_json * v, const char * const (&keys)[N], const std::string & what,
        std::string & err) {
    if (v == nullptr || v->kind != llama_expert_json::OBJECT) {
        err = what + " is not an object";
        return false;
    }
    std::string missing;
    for (const char * k : keys) {
        if (v->get(k) == nullptr) {
            missing += (missing.empty() ? "" : ", ") + std::string(k);
        }
    }
    if (!missing.empty()) {
        err = what + " lacks " + missing;
        return false;
    }
    return true;
}

static std::string tuned_trim(const std::string & s) {
    const size_t b = s.find_first_not_of(" \t\n\r\f\v");
    const size_t e = s.find_last_not_of(" \t\n\r\f\v");
    return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// the policy's items "key=value" split at commas, keys from LLAMA_EXPERT_TUNED_POLICY_KEYS, once each
static bool tuned_policy_keys_ok(const std::string & policy) {
    static const char * const allowed[] = LLAMA_EXPERT_TUNED_POLICY_KEYS;
    std::vector<std::string> seen;
    size_t pos = 0;
    while (true) {
        const size_t end = std::min(policy.find(',', pos), policy.size());
        const std::string item = policy.substr(pos, end - pos);
        const std::string key  = tuned_trim(item.substr(0, item.find('=')));
        bool known = false;
        for (const char * a : allowed) {
            known = known || key == a;
        }
        for (const std::string & s : seen) {
            known = known && s != key;
        }
        if (!known) {
            return false;
        }
        seen.push_back(key);
        if (end == policy.size()) {
            return true;
        }
        pos = end + 1;
    }
}

static std::string tuned_list(const char * const * items, size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) {
        s += (i ? ", " : "") + std::string(items[i]);
    }
    return s;
}

std::vector<std::string> llama_expert_tuned_locations(const std::string & model_path, const std::string & fingerprint,
        const char * moe_subst_cache, const char * xdg_cache_home, const char * home) {
    std::vector<std::string> out = { model_path + LLAMA_EXPERT_TUNED_SUFFIX };
    std::string cache;
    if (moe_subst_cache != nullptr && moe_subst_cache[0] != '\0') {
        cache = moe_subst_cache;
    } else if (xdg_cache_home != nullptr && xdg_cache_home[0] != '\0') {
        cache = std::string(xdg_cache_home) + "/moe-subst";
    } else if (home != nullptr && home[0] != '\0') {
        cache = std::string(home) + "/.cache/moe-subst";
    }
    if (!cache.empty()) {
        const size_t slash = model_path.find_last_of('/');
        const std::string name = slash == std::string::npos ? model_path : model_path.substr(slash + 1);
        while (cache.size() > 1 && cache.back() == '/') {
            cache.pop_back();
        }
        out.push_back(cache + "/tune/" + name + "." + fingerprint + LLAMA_EXPERT_TUNED_SUFFIX);
        out.push_back(cache + "/tune/" + name + LLAMA_EXPERT_TUNED_SUFFIX);
    }
    return out;
}

std::string llama_expert_tuned_find(const std::string & model_path, const std::string & fingerprint) {
    if (model_path.empty()) {
        return "";
    }
    for (const std::string & p : llama_expert_tuned_locations(model_path, fingerprint, getenv("MOE_SUBST_CACHE"),
            getenv("XDG_CACHE_HOME"), getenv("HOME"))) {
        struct stat st;
        if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
            return p;
        }
    }
    return "";
}

static bool tuned_parse_body(const llama_expert_json & d, llama_expert_tuned_profile & p, std::string & err) {
    const llama_expert_json * model = d.get("model");
    if (!tuned_has_all(model, TUNED_MODEL_KEYS, "model", err)) {
        return false;
    }
    if (!tuned_has_all(d.get("machine"), TUNED_MACHINE_KEYS, "machine", err)) {
        return false;
    }
    const llama_expert_json * choices = d.get("choices");
    if (choices == nullptr || choices->kind != llama_expert_json::ARRAY || choices->items.empty()) {
        err = "choices is not a non-empty list";
        return false;
    }
    for (size_t i = 0; i < choices->items.size(); ++i) {
        if (!tuned_has_all(&choices->items[i], TUNED_CHOICE_KEYS, "choices[" + std::to_string(i) + "]", err)) {
            return false;
        }
    }
    static const char * const policy_keys[] = LLAMA_EXPERT_TUNED_POLICY_KEYS;
    for (size_t i = 0; i < choices->items.size(); ++i) {
        const llama_expert_json & c = choices->items[i];
        const std::string what = "choices[" + std::to_string(i) + "].";
        llama_expert_tuned_choice ch;
        double unused = 0.0;
        if (!tuned_num(c.get("fraction"), what + "fraction", unused, err) ||
            !tuned_num(c.get("delta_pct"), what + "delta_pct", ch.delta_pct, err) ||
            !tuned_num(c.get("ci_low"), what + "ci_low", ch.ci_low, err) ||
            !tuned_num(c.get("ci_high"), what + "ci_high", ch.ci_high, err) ||
            !tuned_num(c.get("est_tokens_per_s"), what + "est_tokens_per_s", unused, err)) {
            return false;
        }
        const llama_expert_json * slots = c.get("slots");
        if (slots->kind != llama_expert_json::NUMBER || !slots->integer || std::fabs(slots->number) > 1e15) {
            err = what + "slots is " + tuned_repr(slots) + ", not an integer";
            return false;
        }
        ch.slots = (int64_t) slots->number;
        const llama_expert_json * policy = c.get("policy");
        if (policy->kind != llama_expert_json::STRING || !tuned_policy_keys_ok(policy->str)) {
            err = what + "policy " + tuned_repr(policy) + " is not a policy's spec keys (once each, from " +
                tuned_list(policy_keys, sizeof(policy_keys)/sizeof(policy_keys[0])) + ")";
            return false;
        }
        ch.policy    = policy->str;
        ch.residency = tuned_str(c.get("residency"));
        p.choices.push_back(ch);
    }
    const llama_expert_json * bound = d.get("bound");
    const llama_expert_json * text  = d.get("text");
    if (bound == nullptr || bound->kind != llama_expert_json::OBJECT || text == nullptr ||
            text->kind != llama_expert_json::OBJECT) {
        err = "bound or text is not an object";
        return false;
    }
    static const char * const bound_on[] = LLAMA_EXPERT_TUNED_BOUND_ON;
    const llama_expert_json * on = bound->get("on");
    bool on_ok = false;
    for (const char * b : bound_on) {
        on_ok = on_ok || (on != nullptr && on->kind == llama_expert_json::STRING && on->str == b);
    }
    if (!on_ok) {
        err = "bound.on is " + tuned_repr(on) + ", not one of " + tuned_list(bound_on, 2);
        return false;
    }
    p.bound_on = on->str;
    if (!tuned_num(bound->get("max_delta_ppl_pct"), "bound.max_delta_ppl_pct", p.bound_pct, err)) {
        return false;
    }
    p.created         = tuned_str(d.get("created"));
    p.file_name       = tuned_str(model->get("file_name"));
    p.file_bytes      = tuned_str(model->get("file_bytes"));
    p.file_bytes_num  = model->get("file_bytes")->kind == llama_expert_json::NUMBER;
    p.file_bytes_val  = model->get("file_bytes")->number;
    p.fingerprint     = tuned_str(model->get("fingerprint"));
    p.fingerprint_str = model->get("fingerprint")->kind == llama_expert_json::STRING;
    return true;
}

bool llama_expert_tuned_parse(const std::string & text, const std::string & source, llama_expert_tuned_profile & p,
        std::string & err) {
    p = llama_expert_tuned_profile();
    llama_expert_json d;
    std::string jerr;
    if (!llama_expert_json::parse(text, d, jerr)) {
        err = "the tuned profile " + source + " is not JSON (" + jerr + ")";
        return false;
    }
    const llama_expert_json * schema = d.get("schema");
    if (schema == nullptr || schema->kind != llama_expert_json::STRING || schema->str != LLAMA_EXPERT_TUNED_SCHEMA) {
        err = source + " is not a tuned profile (schema '" LLAMA_EXPERT_TUNED_SCHEMA "')";
        return false;
    }
    // as Python's `!= 1`: 1, 1.0 and true are version 1
    const llama_expert_json * version = d.get("schema_version");
    const bool v1 = version != nullptr &&
        ((version->kind == llama_expert_json::NUMBER && version->number == LLAMA_EXPERT_TUNED_SCHEMA_VERSION) ||
         (version->kind == llama_expert_json::BOOL && version->boolean && LLAMA_EXPERT_TUNED_SCHEMA_VERSION == 1));
    if (!v1) {
        err = "the tuned profile " + source + " has schema_version " + tuned_repr(version) + "; this build reads " +
            std::to_string(LLAMA_EXPERT_TUNED_SCHEMA_VERSION) + ": run harness tune again";
        return false;
    }
    std::string why;
    if (!tuned_parse_body(d, p, why)) {
        err = "the tuned profile " + source + " is damaged: " + why;
        return false;
    }
    return true;
}

bool llama_expert_tuned_check_model(const llama_expert_tuned_profile & p, const llama_expert_tuned_model & mine,
        const std::string & source, std::string & err) {
    const bool same = p.file_bytes_num && p.file_bytes_val == (double) mine.file_bytes && p.fingerprint_str &&
        p.fingerprint == mine.fingerprint;
    if (same) {
        return true;
    }
    err = "the tuned profile " + source + " is of another model (" + p.file_name + ": " + p.file_bytes +
        " bytes, fingerprint " + p.fingerprint + "; this model " + mine.file_name + ": " +
        std::to_string(mine.file_bytes) + " bytes, fingerprint " + mine.fingerprint + "): run harness tune on this model";
    return false;
}

void llama_expert_tuned_pick(const llama_expert_tuned_profile * p, int32_t planned_slots, const std::string & source,
        std::string & policy, std::string & why) {
    policy.clear();
    if (p == nullptr) {
        why = "policy quality (no tuned profile)";
        return;
    }
    const llama_expert_tuned_choice * best = nullptr;
    for (const auto & c : p->choices) {
        if (c.slots <= planned_slots && (best == nullptr || c.slots > best->slots)) {
            best = &c;
        }
    }
    if (best == nullptr) {
        std::string tuned;
        for (const auto & c : p->choices) {
            tuned += (tuned.empty() ? "" : ", ") + c.residency + " (" + std::to_string(c.slots) + " slots)";
        }
        why = "policy quality (the tuned profile " + source + " was tuned at " + tuned + ", more than the " +
            std::to_string(planned_slots) + " slots planned)";
        return;
    }
    policy = best->policy;
    why = "policy " + best->policy + " (tuned " + p->created + ": delta-PPL " +
        tuned_format("%+.2f%% [%+.2f, %+.2f] <= %g%%", best->delta_pct, best->ci_low, best->ci_high, p->bound_pct) +
        " on the " + p->bound_on + " at " + best->residency + ")";
}

void llama_expert_tuned_policy(const std::string & path, const llama_expert_tuned_model & mine, int32_t planned_slots,
        std::string & policy, std::string & why) {
    policy.clear();
    if (path.empty()) {
        llama_expert_tuned_pick(nullptr, planned_slots, path, policy, why);
        return;
    }
    std::string err;
    std::string text;
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
        err = "the tuned profile " + path + " is not a regular file";
    } else if ((uint64_t) st.st_size > TUNED_MAX_BYTES) {
        err = "the tuned profile " + path + tuned_format(" is %.1f MiB, more than a profile (at most %.0f MiB)",
            st.st_size / 1048576.0, TUNED_MAX_BYTES / 1048576.0);
    } else {
        std::ifstream f(path, std::ios::binary);
        if (!f) {
            err = "cannot read the tuned profile " + path;
        } else {
            std::ostringstream ss;
            ss << f.rdbuf();
            text = ss.str();
        }
    }
    llama_expert_tuned_profile p;
    if (err.empty() && llama_expert_tuned_parse(text, path, p, err) && llama_expert_tuned_check_model(p, mine, path, err)) {
        llama_expert_tuned_pick(&p, planned_slots, path, policy, why);
        return;
    }
    why = "policy quality (" + err + ")";
}
