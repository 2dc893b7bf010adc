#include "llama-expert-cache-api.h"

#include "llama-context.h"
#include "llama-expert-cache.h"
#include "llama-expert-cache-impl.h"
#include "llama-expert-health.h"
#include "llama-expert-writer.h"

#include <cstdarg>
#include <cstdio>
#include <string>

// counters for applications (llama-expert-cache-api.h)

bool llama_expert_cache_counters_get(const llama_context * ctx, llama_expert_cache_counters * out) {
    const llama_expert_cache * handle = ctx ? ctx->get_moe_cache() : nullptr;
    const llama_expert_cache_impl * cache = handle ? handle->impl.get() : nullptr;
    if (cache == nullptr || out == nullptr) {
        return false;
    }
    *out = {};
    out->mode      = (int32_t) cache->cfg.mode;
    out->n_slots   = cache->n_slots;
    out->n_expert  = cache->n_expert;
    out->group_max = cache->group_max;
    out->async     = cache->engine && cache->engine->async() ? 1 : 0;

    const auto t = cache->total();
#define LLAMA_EXPERT_COUNTER_COPY(field, metric, help) out->field = t.field;
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_COPY)
#undef LLAMA_EXPERT_COUNTER_COPY
    for (const auto & L : cache->layers) {
        out->bypass_token_layers += L->bypass_tokens;
        out->route_ns            += L->route_ns;
    }
    if (cache->engine) {
        const auto e = cache->engine_total();
        out->bank_bytes = cache->engine->total_size();
#define LLAMA_EXPERT_COUNTER_COPY(field, metric, help) out->field = e.field;
        LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_COPY)
#undef LLAMA_EXPERT_COUNTER_COPY
    }
    return true;
}

static void text_printf(std::string & s, const char * fmt, ...) {
    char buf[512];
    va_list args;
    va_start(args, fmt);
    const int n = vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    if (n > 0) {
        s.append(buf, (size_t) n < sizeof(buf) ? (size_t) n : sizeof(buf) - 1);
    }
}

static int32_t text_out(const std::string & s, char * buf, size_t size) {
    if (buf && size > 0) {
        const size_t n = s.size() < size - 1 ? s.size() : size - 1;
        s.copy(buf, n);
        buf[n] = '\0';
    }
    return (int32_t) s.size();
}

// one metric in llama-server's format (# HELP, # TYPE, value); counters are printed as integers, so that they
// stay exact as they grow, times in seconds
static void metric_row(std::string & s, const char * type, const std::string & name, const char * help, uint64_t value,
        bool ns) {
    text_printf(s, "# HELP llamacpp:%s %s\n# TYPE llamacpp:%s %s\n", name.c_str(), help, name.c_str(), type);
    if (ns) {
        text_printf(s, "llamacpp:%s %.9f\n", name.c_str(), 1e-9 * (double) value);
    } else {
        text_printf(s, "llamacpp:%s %llu\n", name.c_str(), (unsigned long long) value);
    }
}

static bool metric_is_seconds(const char * metric) {
    const std::string m(metric);
    return m.size() > 8 && m.compare(m.size() - 8, 8, "_seconds") == 0;
}

int32_t llama_expert_cache_metrics(const llama_context * ctx, char * buf, size_t size) {
    llama_expert_cache_counters c = {};
    if (!llama_expert_cache_counters_get(ctx, &c)) {
        return text_out(std::string(), buf, size);
    }
    std::string s;
#define LLAMA_EXPERT_COUNTER_METRIC(field, metric, help) \
    metric_row(s, "counter", "moe_cache_" #metric "_total", "Expert cache: " help, c.field, metric_is_seconds(#metric));
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_METRIC)
    LLAMA_EXPERT_ROUTE_COUNTERS(LLAMA_EXPERT_COUNTER_METRIC)
    LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_METRIC)
#undef LLAMA_EXPERT_COUNTER_METRIC
    metric_row(s, "gauge", "moe_cache_slots", "Expert cache: resident experts per MoE layer", (uint64_t) c.n_slots, false);
    metric_row(s, "gauge", "moe_cache_bank_bytes", "Expert cache engine: bytes of the cache banks", c.bank_bytes, false);
    const auto & shadow = ctx->get_moe_cache()->impl->shadow;
    if (shadow) {
        // the cache's measured cost (shadow=): the estimate and its 95% interval
        const llama_expert_shadow_summary sh = shadow->summary();
        metric_row(s, "counter", "moe_cache_shadow_ubatches_total", "Expert cache shadow estimate: ubatches computed "
            "twice (exactly, then served)", sh.ubatches, false);
        const struct { const char * name; const char * help; double v; } gauges[] = {
            { "moe_cache_shadow_dppl_pct", "Expert cache shadow estimate: delta-PPL% of the served run", sh.dppl_pct },
            { "moe_cache_shadow_dppl_pct_low", "Expert cache shadow estimate: its 95% CI, lower end", sh.dppl_pct_low },
            { "moe_cache_shadow_dppl_pct_high", "Expert cache shadow estimate: its 95% CI, upper end", sh.dppl_pct_high },
            { "moe_cache_shadow_kl_nats", "Expert cache shadow estimate: KL(exact || served) per token, nats", sh.kl.mean },
        };
        for (const auto & g : gauges) {
            text_printf(s, "# HELP llamacpp:%s %s\n# TYPE llamacpp:%s gauge\nllamacpp:%s %.9g\n", g.name, g.help,
                g.name, g.name, g.v);
        }
    }
    return text_out(s, buf, size);
}

int32_t llama_expert_cache_props(const llama_context * ctx, char * buf, size_t size) {
    llama_expert_cache_counters c = {};
    if (!llama_expert_cache_counters_get(ctx, &c)) {
        return text_out(std::string(), buf, size);
    }
    const llama_expert_cache_config & cfg = ctx->get_moe_cache()->impl->cfg;
    std::string s;
    text_printf(s, "{\"mode\": \"%s\", \"policy\": \"%s\", \"rule\": \"%s\", \"tau\": %.6g, \"evict\": \"%s\", "
            "\"admit\": %s, \"host\": \"%s\", ", c.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE ? "engine" : "emulate",
            cfg.preset.c_str(), llama_expert_miss_rule_name(cfg.rule), cfg.tau, llama_expert_evict_name(cfg.evict),
            cfg.admit ? "true" : "false", cfg.host_file ? "file" : "ram");
    text_printf(s, "\"n_slots\": %d, \"n_expert\": %d, \"group_max\": %d, \"bank_bytes\": %llu, \"async\": %s}",
            c.n_slots, c.n_expert, c.group_max, (unsigned long long) c.bank_bytes, c.async ? "true" : "false");
    return text_out(s, buf, size);
}

int32_t llama_expert_cache_auto_plan(const llama_context * ctx, char * buf, size_t size) {
    return text_out(ctx ? llama_expert_cache_auto_line(ctx->get_model()) : std::string(), buf, size);
}

void llama_expert_cache_write_files(void) {
    llama_expert_writer_request();
}

int32_t llama_expert_cache_health(char * buf, size_t size) {
    return text_out(llama_expert_health_failure(), buf, size);
}
