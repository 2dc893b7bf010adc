#pragma once

// The tuned profile that `harness tune` writes and `--moe-cache auto` reads (docs/expert-cache.md, "Tuned profile"):
// where it is looked for, its schema, the model check and the choice auto takes. The Python reference is
// harness.domain.tune (profile_locations, tune_cache_dir, parse_tune_profile, check_profile_model, tuned_policy;
// auto_policy_of_text composes them): tests/test_tuned.py runs both on the same cases (tests/cpp/tuned_read.cpp) and
// checks that they agree. Model-free: the caller gives the model's identity (llama-expert-cache.cpp computes the
// fingerprint with llama-expert-fingerprint.h).

#include <cstdint>
#include <string>
#include <vector>

#define LLAMA_EXPERT_TUNED_SCHEMA         "moe-subst/tune-profile"
#define LLAMA_EXPERT_TUNED_SCHEMA_VERSION 1
#define LLAMA_EXPERT_TUNED_SUFFIX         ".moe-tune.json"

// the spec keys a profile's policy may hold, once each (harness.domain.tune.POLICY_KEYS; tests/test_tuned.py checks
// that the two lists are equal)
#define LLAMA_EXPERT_TUNED_POLICY_KEYS { "rule", "tau", "evict", "admit", "prefetch", "tau_file", "halve" }

// the bound's two readings (harness.domain.tune.BOUND_ON)
#define LLAMA_EXPERT_TUNED_BOUND_ON { "point estimate", "95% CI upper end" }

// One entry of `choices`: what the reader uses of it.
struct llama_expert_tuned_choice {
    std::string residency;
    int64_t     slots     = 0;
    std::string policy;     // spec keys "key=value,..."
    double      delta_pct = 0.0;
    double      ci_low    = 0.0;
    double      ci_high   = 0.0;
};

// A profile, as read: the model it was tuned on, the bound, the choices.
struct llama_expert_tuned_profile {
    std::string created;
    std::string file_name;
    // model.file_bytes and model.fingerprint as written (for the message), and whether they are a number and a
    // string (the model check compares only those)
    std::string file_bytes;
    bool        file_bytes_num = false;
    double      file_bytes_val = 0.0;
    std::string fingerprint;
    bool        fingerprint_str = false;
    double      bound_pct = 0.0;
    std::string bound_on;
    std::vector<llama_expert_tuned_choice> choices;
};

// The model auto runs: its file's name and size, its fingerprint as 16 lowercase hex digits.
struct llama_expert_tuned_model {
    std::string file_name;
    uint64_t    file_bytes = 0;
    std::string fingerprint;
};

// The places looked in, in this order: <model path>.moe-tune.json; <cache>/tune/<model file name>.<fingerprint>.moe-tune.json
// (keyed by the model's fingerprint, 16 lowercase hex digits: two models of one file name have two profiles there);
// <cache>/tune/<model file name>.moe-tune.json (the name-only path harness tune wrote before the key; the model check
// refuses it when it is another model's). <cache> = $MOE_SUBST_CACHE, else $XDG_CACHE_HOME/moe-subst, else
// $HOME/.cache/moe-subst (each when set and not empty; no HOME: only the first place). The environment's values are
// arguments so that tests need not set them.
std::vector<std::string> llama_expert_tuned_locations(const std::string & model_path, const std::string & fingerprint,
        const char * moe_subst_cache, const char * xdg_cache_home, const char * home);

// The first of the locations (from the process's environment) that is a regular file; "" when none is (a path that
// exists and is not a regular file, such as a FIFO or a folder, is never opened).
std::string llama_expert_tuned_find(const std::string & model_path, const std::string & fingerprint);

// Steps 2 and 3 of the contract: the text parsed (another schema or schema_version, not JSON, a damaged entry: false
// and a one-line err naming `source`); then the model check (another model: false and the contract's line).
bool llama_expert_tuned_parse(const std::string & text, const std::string & source, llama_expert_tuned_profile & p,
        std::string & err);
bool llama_expert_tuned_check_model(const llama_expert_tuned_profile & p, const llama_expert_tuned_model & mine,
        const std::string & source, std::string & err);

// Steps 4 and 6: of the choices with slots at or below `planned_slots`, the one with the most (the first of equals);
// policy = its spec keys, why = the plan line's policy part. None: policy "" (quality) and why names the residencies
// tuned and the slots planned. p == nullptr: no profile.
void llama_expert_tuned_pick(const llama_expert_tuned_profile * p, int32_t planned_slots, const std::string & source,
        std::string & policy, std::string & why);

// The whole of steps 2-4 and 6 for the file at `path` (read here; "" = none found): the policy ("" = quality) and the
// one-line reason that the plan line ends with ("policy quality (<why the profile was not used>)" on a failure).
void llama_expert_tuned_policy(const std::string & path, const llama_expert_tuned_model & mine, int32_t planned_slots,
        std::string & policy, std::string & why);
