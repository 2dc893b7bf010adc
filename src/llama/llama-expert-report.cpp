#include "llama-expert-cache-impl.h"

#include "llama-impl.h"

#include <algorithm>
#include <cstdio>

//
// statistics
//

llama_expert_engine_stats llama_expert_cache_impl::engine_total() const {
    GGML_ASSERT(engine);
    auto e = engine->total();
    for (const auto & L : layers) {
        if (L->moe) {
            const uint64_t bytes = engine->expert_bytes(L->il);
            e.prefetch_bytes        += L->policy.stats.prefetches * bytes;
            e.prefetch_wasted_bytes += L->policy.stats.prefetch_wasted * bytes;
        }
    }
    return e;
}

llama_expert_policy_stats llama_expert_cache_impl::total() const {
    llama_expert_policy_stats t;
    for (const auto & L : layers) {
        if (L->moe) {
            t.add(L->policy.stats);
        }
    }
    return t;
}

static double ratio(uint64_t a, uint64_t b) {
    return b ? (double) a / (double) b : 0.0;
}

void llama_expert_cache_impl::print_stats() const {
    const auto t = total();
    uint64_t route_ns = 0, route_tokens = 0;
    for (const auto & L : layers) {
        route_ns     += L->route_ns;
        route_tokens += L->route_tokens;
    }
    LLAMA_LOG_INFO("%s: expert cache (%s, policy %s, %d/%d slots): %llu token-layers, %llu calls: "
        "hits %.2f%%, misses %.2f%%, fetches %llu, substitutions %llu (%.2f%%, %llu first choices, max weight %.3f), "
        "drops %llu, host computes %llu, skips %llu, admissions %llu, evictions %llu, mean substituted mass %.4f, "
        "route step %.3f us per token-layer\n",
        __func__, llama_expert_cache_mode_name(cfg.mode), cfg.preset.c_str(), n_slots, n_expert,
        (unsigned long long) t.token_layers, (unsigned long long) t.calls,
        100.0 * ratio(t.hits, t.calls), 100.0 * ratio(t.misses, t.calls), (unsigned long long) t.fetches,
        (unsigned long long) t.substitutions, 100.0 * ratio(t.substitutions, t.calls), (unsigned long long) t.subst_first_choice,
        t.max_subst_weight, (unsigned long long) t.drops, (unsigned long long) t.host_computes, (unsigned long long) t.skips,
        (unsigned long long) t.admissions, (unsigned long long) t.evictions,
        t.token_layers ? t.subst_mass_sum / t.token_layers : 0.0, route_tokens ? 1e-3 * route_ns / route_tokens : 0.0);
    if (cfg.prefetch) {
        LLAMA_LOG_INFO("%s: expert cache prefetch: %llu experts prefetched (%.2f per token-layer), %llu used before "
            "eviction (%.1f%%), %llu evicted unused\n", __func__, (unsigned long long) t.prefetches,
            ratio(t.prefetches, t.token_layers), (unsigned long long) t.prefetch_used,
            100.0 * ratio(t.prefetch_used, t.prefetches), (unsigned long long) t.prefetch_wasted);
    }
    if (shadow) {
        const auto sh = shadow->summary();
        LLAMA_LOG_INFO("%s: expert cache shadow estimate: delta-PPL %+.2f%% [%+.2f, %+.2f] (95%% CI over %llu ubatches "
            "computed twice, %llu next tokens), KL %.5f nats per token [%.5f, %.5f] over %llu rows, %.1f ms\n", __func__,
            sh.dppl_pct, sh.dppl_pct_low, sh.dppl_pct_high, (unsigned long long) sh.ubatches,
            (unsigned long long) sh.pairs, sh.kl.mean, sh.kl.low, sh.kl.high, (unsigned long long) sh.rows, sh.shadow_ms);
    }
    if (engine) {
        const auto e = engine_total();
        LLAMA_LOG_INFO("%s: expert cache engine: banks %.2f MiB, %llu experts copied (%.2f MiB in %llu copies, %.3f ms), "
            "%llu in the background (%s, %llu deferred, %.3f ms waited)\n",
            __func__, engine->total_size()/1024.0/1024.0, (unsigned long long) e.copied_experts,
            e.copy_bytes/1024.0/1024.0, (unsigned long long) e.copies, 1e-6 * e.copy_ns,
            (unsigned long long) e.background_experts, engine->async() ? "async" : "synchronous",
            (unsigned long long) e.deferred_experts, 1e-6 * e.wait_ns);
        if (!engine->files.empty()) {
            LLAMA_LOG_INFO("%s: expert cache file tier: %llu reads (%.2f MiB, %.3f ms), %s\n", __func__,
                (unsigned long long) e.file_reads, e.file_read_bytes/1024.0/1024.0, 1e-6 * e.file_read_ns,
                engine->pack ? format("one per expert from the expert pack %s", engine->pack->file->path.c_str()).c_str()
                             : "one per expert tensor (no expert pack)");
        }
    }
}

// n_tokens: tokens decided (for a total: the most token_layers of any MoE layer)
static void write_stats_obj(FILE * f, const llama_expert_policy_stats & s, uint64_t n_tokens, const char * indent) {
#define LLAMA_EXPERT_COUNTER_JSON(field, metric, help) \
    fprintf(f, "%s\"" #field "\": %llu,\n", indent, (unsigned long long) s.field);
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_JSON)
#undef LLAMA_EXPERT_COUNTER_JSON
    fprintf(f, "%s\"max_subst_weight\": %.9g,\n", indent, s.max_subst_weight);
    fprintf(f, "%s\"subst_mass_sum\": %.17g,\n", indent, s.subst_mass_sum);
    fprintf(f, "%s\"tokens\": %llu,\n", indent, (unsigned long long) n_tokens);
    fprintf(f, "%s\"substituted_mass\": %.17g,\n", indent, s.token_layers ? s.subst_mass_sum / s.token_layers : 0.0);
    fprintf(f, "%s\"fetches_per_token\": %.17g,\n", indent, ratio(s.fetches, n_tokens));
    fprintf(f, "%s\"drop_mass_sum\": %.17g,\n", indent, s.drop_mass_sum);
    fprintf(f, "%s\"hit_rate\": %.17g,\n", indent, ratio(s.hits, s.calls));
    fprintf(f, "%s\"miss_rate\": %.17g,\n", indent, ratio(s.misses, s.calls));
    fprintf(f, "%s\"substitution_rate\": %.17g,\n", indent, ratio(s.substitutions, s.calls));
    fprintf(f, "%s\"mass_hist\": [", indent);
    for (int i = 0; i < LLAMA_EXPERT_MASS_HIST_BINS; ++i) {
        fprintf(f, "%s%llu", i ? ", " : "", (unsigned long long) s.mass_hist[i]);
    }
    fprintf(f, "]\n");
}

bool llama_expert_cache_impl::write_stats(const std::string & path) const {
    FILE * f = fopen(path.c_str(), "w");
    if (!f) {
        return false;
    }
    fprintf(f, "{\n");
    fprintf(f, "  \"schema\": \"moe-subst/expert-cache-stats\",\n");
    fprintf(f, "  \"schema_version\": %d,\n", LLAMA_EXPERT_STATS_SCHEMA_VERSION);
    fprintf(f, "  \"config\": {\n");
    fputs(llama_expert_cache_config_json(cfg, n_expert, n_used, n_slots, "    ").c_str(), f);
    fprintf(f, "  },\n");
    fprintf(f, "  \"mass_hist_edges\": [");
    for (int i = 0; i <= LLAMA_EXPERT_MASS_HIST_BINS; ++i) {
        fprintf(f, "%s%.9g", i ? ", " : "", (double) i / LLAMA_EXPERT_MASS_HIST_BINS);
    }
    fprintf(f, "],\n");
    uint64_t route_ns = 0, route_tokens = 0;
    for (const auto & L : layers) {
        route_ns     += L->route_ns;
        route_tokens += L->route_tokens;
    }
    if (engine) {
        const auto e = engine_total();
        fprintf(f, "  \"engine\": {\"bank_bytes\": %llu, ", (unsigned long long) engine->total_size());
#define LLAMA_EXPERT_COUNTER_JSON(field, metric, help) \
        fprintf(f, "\"" #field "\": %llu, ", (unsigned long long) e.field);
        LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_JSON)
#undef LLAMA_EXPERT_COUNTER_JSON
        fprintf(f, "\"async\": %s, \"pack\": %s},\n", engine->async() ? "true" : "false",
            llama_expert_json_str(engine->pack ? engine->pack->file->path : "").c_str());
    }
    fprintf(f, "  \"group_max\": %d,\n", group_max);
    uint64_t bypass_tl = 0;
    for (const auto & L : layers) {
        bypass_tl += L->bypass_tokens;
    }
    fprintf(f, "  \"bypass\": %u,\n", cfg.bypass);
    fprintf(f, "  \"bypass_token_layers\": %llu,\n", (unsigned long long) bypass_tl);
    fprintf(f, "  \"route_ns\": %llu,\n", (unsigned long long) route_ns);
    fprintf(f, "  \"route_ns_per_token_layer\": %.6g,\n", route_tokens ? (double) route_ns / route_tokens : 0.0);
    if (shadow) {
        const auto sh = shadow->summary();
        fprintf(f, "  \"shadow\": {\"every\": %u, \"ubatches\": %llu, \"rows\": %llu, \"pairs\": %llu, "
            "\"kl\": %.9g, \"kl_low\": %.9g, \"kl_high\": %.9g, \"dnll\": %.9g, \"dnll_low\": %.9g, "
            "\"dnll_high\": %.9g, \"dppl_pct\": %.9g, \"dppl_pct_low\": %.9g, \"dppl_pct_high\": %.9g, "
            "\"shadow_ms\": %.6g},\n", sh.every, (unsigned long long) sh.ubatches, (unsigned long long) sh.rows,
            (unsigned long long) sh.pairs, sh.kl.mean, sh.kl.low, sh.kl.high, sh.dnll.mean, sh.dnll.low, sh.dnll.high,
            sh.dppl_pct, sh.dppl_pct_low, sh.dppl_pct_high, sh.shadow_ms);
    }
    if (test_gating) {
        uint64_t checked = 0;
        double rmin = 1e300, rmax = -1e300;
        for (const auto & L : layers) {
            checked += L->gating_checked;
            rmin = std::min(rmin, L->gating_ratio_min);
            rmax = std::max(rmax, L->gating_ratio_max);
        }
        fprintf(f, "  \"gating_check\": {\"checked\": %llu, \"ratio_min\": %.9g, \"ratio_max\": %.9g},\n",
            (unsigned long long) checked, checked ? rmin : 0.0, checked ? rmax : 0.0);
    }
    fprintf(f, "  \"total\": {\n");
    // tokens decided: those that reached the first MoE layer (graphs may skip unused tokens in the last layer)
    uint64_t n_tokens = 0;
    for (const auto & L : layers) {
        if (L->moe) {
            n_tokens = std::max(n_tokens, L->policy.stats.token_layers);
        }
    }
    const auto t = total();
    write_stats_obj(f, t, n_tokens, "    ");
    fprintf(f, "  },\n");
    fprintf(f, "  \"layers\": [");
    bool first = true;
    for (const auto & L : layers) {
        if (!L->moe) {
            continue;
        }
        fprintf(f, "%s\n    {\n      \"layer\": %d,\n", first ? "" : ",", L->il);
        write_stats_obj(f, L->policy.stats, L->policy.stats.token_layers, "      ");
        fprintf(f, "    }");
        first = false;
    }
    fprintf(f, "\n  ]\n}\n");
    const bool ok = !ferror(f);
    return fclose(f) == 0 && ok;
}
