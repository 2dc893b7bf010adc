#pragma once

// moe-subst: no includes, so that the policy can be compiled alone (tests, llama-moe-sim).

// The expert cache's counters, in one table. Each X(field, metric, help) is a uint64_t counter; metric is
// the name on llama-server's /metrics (llamacpp:moe_cache_<metric>_total; a metric named *_seconds is the
// field in ns, shown in seconds). The table generates the statistics structs and their sums, the statistics
// JSON (stats=PATH), llama_expert_cache_counters and the /metrics rows; harness/parsers/cache_stats.py checks
// the JSON against it (tests/test_stats_schema.py reads this table).
//
// decisions of the residency policy (llama_expert_policy_stats), per MoE layer and summed over layers
#define LLAMA_EXPERT_POLICY_COUNTERS(X) \
    X(calls,                   calls,                   "selected expert calls") \
    X(hits,                    hits,                    "calls served by a resident expert") \
    X(misses,                  misses,                  "calls whose expert was not resident") \
    X(fetches,                 fetches,                 "misses fetched synchronously") \
    X(substitutions,           substitutions,           "misses computed by a resident substitute") \
    X(drops,                   drops,                   "misses dropped") \
    X(host_computes,           host_computes,           "misses computed on the host with the missed expert (light=host)") \
    X(skips,                   skips,                   "selections skipped by rule=ser before the cache (resident or not)") \
    X(admissions,              admissions,              "background admissions") \
    X(evictions,               evictions,               "experts evicted") \
    X(subst_first_choice,      subst_first_choice,      "substitutions of a first choice (rank 0)") \
    X(forced_substitutions,    forced_substitutions,    "substitutions forced because every slot was in use by the token") \
    X(token_layers,            token_layers,            "token-layers decided") \
    X(token_layers_with_subst, token_layers_with_subst, "token-layers with at least one substitution") \
    X(ram_tier_loads,          ram_tier_loads,          "three tiers: experts loaded into the slots from the RAM tier") \
    X(file_loads,              file_loads,              "three tiers: experts loaded into the slots from the model file, through the RAM tier") \
    X(prefetches,              prefetches,              "experts admitted by prefetch (prefetch=on: the next MoE layer's router, predicted)") \
    X(prefetch_used,           prefetch_used,           "prefetched experts computed with (selected, or a substitute) before their eviction") \
    X(prefetch_wasted,         prefetch_wasted,         "prefetched experts evicted before they were computed with")

// mode=engine: the copies into the cache banks (llama_expert_engine_stats), summed over layers
#define LLAMA_EXPERT_ENGINE_COUNTERS(X) \
    X(copied_experts,     copied_experts,     "experts copied into cache slots (all banks of an expert count once)") \
    X(copies,             copies,             "copy calls (one per run of consecutive slots and bank)") \
    X(copy_bytes,         copy_bytes,         "bytes copied into cache slots") \
    X(copy_ns,            copy_seconds,       "host time copying into cache slots") \
    X(background_experts, background_experts, "experts copied as background admissions") \
    X(deferred_experts,   deferred_experts,   "background admissions deferred to the next step (next to a slot in use)") \
    X(wait_ns,            copy_wait_seconds,  "host time waiting for background copies") \
    X(file_reads,         file_reads,         "reads from the model file (host=file)") \
    X(file_read_bytes,    file_read_bytes,    "bytes read from the model file (host=file)") \
    X(file_read_ns,       file_read_seconds,  "time reading the model file, summed over the reader threads (host=file)") \
    X(pack_reads,         pack_reads,         "reads of whole experts from the expert pack (host=file with a pack; also in file_reads)") \
    X(pack_read_bytes,    pack_read_bytes,    "bytes read from the expert pack (host=file with a pack; also in file_read_bytes)") \
    X(prefetch_bytes,     prefetch_bytes,     "bytes of the experts admitted by prefetch (prefetch=on)") \
    X(prefetch_wasted_bytes, prefetch_wasted_bytes, "bytes of the prefetched experts evicted before they were computed with")

// the route step (all modes)
#define LLAMA_EXPERT_ROUTE_COUNTERS(X) \
    X(bypass_token_layers, bypass_token_layers, "token-layers of the prefill bypass (stock routing)") \
    X(route_ns,            route_seconds,       "host time of the route step")

#define LLAMA_EXPERT_COUNTER_FIELD(field, metric, help) uint64_t field;
