// The statistics' "config" block (moe-subst): the parsed spec's fields as JSON, from LLAMA_EXPERT_CONFIG_FIELDS
// (llama-expert-spec.h), and the JSON string escape the writers share.
#include "llama-expert-spec.h"

#include <cstdio>
#include <string>

std::string llama_expert_json_str(const std::string & s) {
    std::string o = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            o += '\\'; o += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            snprintf(buf, sizeof(buf), "\\u%04x", c);
            o += buf;
        } else {
            o += c;
        }
    }
    return o + "\"";
}

static std::string config_value_STR(const std::string & v) { return llama_expert_json_str(v); }
static std::string config_value_NAME(const char * v)       { return std::string("\"") + v + "\""; }
static std::string config_value_BOOL(bool v)               { return v ? "true" : "false"; }
static std::string config_value_INT(int32_t v)             { return std::to_string(v); }
static std::string config_value_UINT(uint32_t v)           { return std::to_string(v); }
static std::string config_value_FLOAT(float v) {
    char buf[32];
    snprintf(buf, sizeof(buf), "%.9g", v);
    return buf;
}

std::string llama_expert_cache_config_json(const llama_expert_cache_config & cfg, int32_t n_expert, int32_t k,
                                           int32_t n_slots, const char * indent) {
    const llama_expert_params par = llama_expert_cache_config_params(cfg);
    (void) par;
    std::string s;
#define LLAMA_EXPERT_CONFIG_FIELD_JSON(field, type, value) \
    s += std::string(s.empty() ? "" : ",\n") + indent + "\"" #field "\": " + config_value_##type(value);
    LLAMA_EXPERT_CONFIG_FIELDS(LLAMA_EXPERT_CONFIG_FIELD_JSON)
#undef LLAMA_EXPERT_CONFIG_FIELD_JSON
    return s + "\n";
}
