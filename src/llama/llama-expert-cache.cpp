#include "llama-expert-cache.h"

#include "llama-expert-cache-impl.h"

#include "llama-expert-fingerprint.h"
#include "llama-expert-health.h"

#include "llama-expert-profile.h"
#include "llama-expert-machine.h"
#include "llama-expert-measure.h"
#include "llama-expert-resident.h"
#include "llama-expert-tuned.h"
#include "llama-expert-writer.h"

#include "llama-adapter.h"
#include "llama-context.h"
#include "llama-graph.h"

#include "llama-impl.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"
#include "llama-model.h"

#include "ggml.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include <sys/stat.h>
#include <unistd.h>

//
// the hooks (llama-expert-cache.h): the handle forwards to the cache
//

llama_expert_cache::llama_expert_cache(std::unique_ptr<llama_expert_cache_impl> impl_) : impl(std::move(impl_)) {}

llama_expert_cache::~llama_expert_cache() = default;

std::unique_ptr<llama_expert_cache> llama_expert_cache::from_env(const llama_model & model, const llama_memory_i * memory,
        const llama_cparams & cparams) {
    auto impl = llama_expert_cache_impl::from_env(model, memory, cparams);
    return impl ? std::make_unique<llama_expert_cache>(std::move(impl)) : nullptr;
}

void llama_expert_cache::build_moe_ffn_route(const llm_graph_context & g, int il, ggml_tensor * logits,
        ggml_tensor * exp_probs_b, llama_expert_gating_func_type gating, bool norm_w, ggml_tensor *& selected,
        ggml_tensor *& weights, std::initializer_list<ggml_tensor **> expert_tensors) {
    impl->build_moe_ffn_route(g, il, logits, exp_probs_b, gating, norm_w, selected, weights, expert_tensors);
}

ggml_status llama_expert_cache::compute_ubatch(const llama_ubatch & ubatch, ggml_tensor * t_logits,
        ggml_backend_sched_t sched, const std::function<ggml_status(bool again)> & compute) {
    return impl->shadow ? impl->shadow->compute_ubatch(ubatch, t_logits, sched, compute) : compute(false);
}

void llama_expert_cache::memory_breakdown_add(llama_memory_breakdown & ret) const {
    impl->memory_breakdown_add(ret);
}

void llama_expert_cache::chain_abort_callback(bool (*&cb)(void * data), void *& data) {
    impl->chain_abort_callback(cb, data);
}

void llama_expert_cache::reset() {
    impl->reset();
}

// the model file's path of each loaded model (model_loaded); a model freed and another loaded at its address
// replaces its entry, since every load calls the hook
static std::mutex                                 g_model_path_mutex;
static std::map<const llama_model *, std::string> g_model_path;

void llama_expert_cache::model_loaded(const llama_model & model, const char * path) {
    std::lock_guard<std::mutex> lock(g_model_path_mutex);
    g_model_path[&model] = path != nullptr ? path : "";
}

static std::string expert_cache_model_path(const llama_model & model) {
    std::lock_guard<std::mutex> lock(g_model_path_mutex);
    const auto it = g_model_path.find(&model);
    return it == g_model_path.end() ? "" : it->second;
}

// the auto plan line of each model's last context (llama_expert_cache_auto_line), under the same mutex
static std::map<const llama_model *, std::string> g_auto_line;

static void expert_cache_set_auto_line(const llama_model & model, const std::string & line) {
    std::lock_guard<std::mutex> lock(g_model_path_mutex);
    g_auto_line[&model] = line;
}

std::string llama_expert_cache_auto_line(const llama_model & model) {
    std::lock_guard<std::mutex> lock(g_model_path_mutex);
    const auto it = g_auto_line.find(&model);
    return it == g_auto_line.end() ? "" : it->second;
}

//
// construction
//

static std::unique_ptr<llama_expert_cache_impl> expert_cache_create(const llama_model & model, const llama_memory_i * memory,
        const llama_cparams & cparams, const char * spec);

// LLAMA_MOE_CACHE_TEST_REPLAY replaces the routing in the cache's route step: a run without the cache would ignore it
// and look like a replayed one
static void replay_needs_cache(const llama_model & model) {
    const char * replay = getenv(LLAMA_EXPERT_REPLAY_ENV);
    if (replay != nullptr && replay[0] != '\0' && !model.hparams.no_alloc) { // said once, by the real context
        throw std::runtime_error(std::string(LLAMA_EXPERT_REPLAY_ENV) + " is set, but the expert cache is off: routing "
            "replay runs in the cache's route step (set LLAMA_MOE_CACHE or --moe-cache, or unset " LLAMA_EXPERT_REPLAY_ENV ")");
    }
}

std::unique_ptr<llama_expert_cache_impl> llama_expert_cache_impl::from_env(const llama_model & model, const llama_memory_i * memory,
        const llama_cparams & cparams) {
    if (!model.hparams.no_alloc) {
        expert_cache_set_auto_line(model, ""); // this context's plan line, if auto makes one
    }
    const char * spec = getenv(LLAMA_EXPERT_CACHE_ENV);
    if (spec == nullptr || spec[0] == '\0') {
        replay_needs_cache(model);
        return nullptr;
    }
    if (model.hparams.no_alloc) {
        // a memory-fitting dry run (llama.cpp's -fit probe, followed by the real context): it plans with the cache's
        // memory when the cache can be made; otherwise without it, silently, so that an error is reported once, by
        // the real context, whose outcome alone counts (the probe loads without mmap and may count the weights
        // differently: it must not refuse a budget that the real context accepts, nor the reverse)
        try {
            return expert_cache_create(model, memory, cparams, spec);
        } catch (const std::exception & e) {
            LLAMA_LOG_DEBUG("%s: the memory-fitting probe plans without the expert cache: %s\n", __func__, e.what());
            return nullptr;
        }
    }
    return expert_cache_create(model, memory, cparams, spec);
}

// `--moe-cache auto`: the spec chosen from the model's and the machine's facts (llama-expert-auto.h), its plan logged in
// one line with why; the keys the user gave after `auto` override the plan's
static std::string expert_cache_auto_spec(const llama_model & model, const char * spec, const std::string & rest,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem, const llama_cparams & cparams) {
    // the user's keys that the decision reads (vram_reserve, readers, policy), parsed alone; defaults where not given
    // or not valid (the composed spec is parsed, and refused in one line, below)
    llama_expert_cache_config given;
    std::string err;
    if (!llama_expert_cache_config_parse(llama_expert_auto_user_items(rest, {"vram_reserve", "readers", "policy"}),
            given, err)) {
        given = llama_expert_cache_config();
    }
    const bool policy_given = llama_expert_auto_user_gives(rest, "policy");
    const bool reserve_given = llama_expert_auto_user_gives(rest, "vram_reserve");
    llama_expert_auto_model facts = llama_expert_engine_auto_facts(model, ctx_mem);
    facts.n_ctx    = cparams.n_ctx;
    // the most outputs a batch may ask for: the context's n_outputs_max (llama-server sets it from its slots), which
    // is n_batch unless the tool lowers it (the logits' buffer never grows past it)
    facts.n_batch  = cparams.n_outputs_max > 0 ? cparams.n_outputs_max : cparams.n_batch;
    facts.n_ubatch = cparams.n_ubatch;
    const llama_expert_machine machine = llama_expert_machine_current();
    facts.n_seq    = cparams.n_seq_max;
    facts.held = machine.self_anon;  // after the KV cache's allocation (patch 0004's call site): it is in there
    llama_expert_auto_plan plan = llama_expert_auto_decide(facts, machine.usable(), machine.describe(),
        reserve_given ? given.vram_reserve : 0, given.readers, policy_given ? given.preset : "", policy_given);
    if (plan.unsure && !model.hparams.no_alloc) {
        // near the fit: whether stock's weights stay resident here, measured (llama-expert-resident.h), and the
        // decision taken again with the answer (with the machine as read before: the touch charged the page cache)
        const llama_expert_resident r = llama_expert_touch_resident(llama_expert_mapped_weight_ranges(model),
            plan.ballast);
        LLAMA_LOG_INFO("%s: auto: near the fit: %.1f of %.1f MiB of mapped weights resident after touching them "
            "beside %.1f MiB\n", __func__, r.resident/1048576.0, r.touched/1048576.0, r.ballast/1048576.0);
        if (r.ok && r.touched > 0) {
            facts.stock_fits     = r.all() ? 1 : 0;
            facts.stock_touched  = r.touched;
            facts.stock_resident = r.resident;
            plan = llama_expert_auto_decide(facts, machine.usable(), machine.describe(),
                reserve_given ? given.vram_reserve : 0, given.readers, policy_given ? given.preset : "", policy_given);
        }
    }
    if (!plan.err.empty()) {
        throw std::runtime_error(std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + spec + "': " + plan.err);
    }
    // the tuned profile's policy (docs/expert-cache.md, "Tuned profile"), unless the user gave one or the plan is off;
    // not in a memory-fitting dry run (no tensor data to fingerprint; the policy does not change the memory)
    std::string tuned_path;
    const llama_expert_auto_plan quality = plan;
    bool tuned_used = false;
    if (!plan.off && !policy_given && !model.hparams.no_alloc) {
        const std::string model_path = expert_cache_model_path(model);
        char fp[32];
        snprintf(fp, sizeof(fp), "%016llx", (unsigned long long) llama_expert_fingerprint_of_model(model));
        tuned_path = llama_expert_tuned_find(model_path, fp);
        if (!tuned_path.empty()) {
            llama_expert_tuned_model mine;
            const size_t slash = model_path.find_last_of('/');
            mine.file_name = slash == std::string::npos ? model_path : model_path.substr(slash + 1);
            struct stat st;
            mine.file_bytes = stat(model_path.c_str(), &st) == 0 ? (uint64_t) st.st_size : 0;
            mine.fingerprint = fp;
            std::string policy;
            std::string why;
            llama_expert_tuned_policy(tuned_path, mine, plan.slots, policy, why);
            // a policy this build's parser refuses on its own (a value it does not know) is the profile's fault: not
            // used, and the line says why
            llama_expert_auto_plan tuned = plan;
            llama_expert_auto_set_policy(tuned, policy, why);
            llama_expert_cache_config probe;
            if (!policy.empty() && !llama_expert_cache_config_parse(tuned.spec(), probe, err)) {
                llama_expert_auto_set_policy(plan, "", "policy quality (the tuned profile " + tuned_path +
                    " has a policy this build refuses: " + err + ")");
            } else {
                plan = tuned;
                tuned_used = !policy.empty();
            }
        }
    }
    const std::string run = llama_expert_auto_spec(plan, rest);
    if (tuned_used) {
        // the user's keys that go with quality and not with the tuned policy (e.g. async=off with a tuned
        // prefetch=on): refused as any spec, the line naming the profile
        llama_expert_cache_config probe;
        if (!llama_expert_cache_config_parse(run, probe, err) &&
                llama_expert_cache_config_parse(llama_expert_auto_spec(quality, rest), probe, err)) {
            llama_expert_cache_config_parse(run, probe, err);
            throw std::runtime_error(std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + spec + "': " + run + ": " + err +
                " (the policy keys are the tuned profile " + tuned_path + "'s: give policy= after auto to override it)");
        }
    }
    if (!model.hparams.no_alloc) {
        // a warning, so that the tools show it at their default verbosity (common shows libllama's info lines only
        // from -lv 4): the user sees what auto chose and why, in one line
        const std::string overridden = llama_expert_auto_overridden(plan, rest);
        const bool forced = plan.off && llama_expert_auto_user_gives(rest, "mode");
        const std::string line = std::string(plan.off && !forced ? "off" : run) + ": " + plan.why +
            (forced ? " (the user's mode= runs the cache all the same)" : "") +
            (overridden.empty() ? "" : " (the user's keys replace the plan's " + overridden + ")");
        LLAMA_LOG_WARN("llama_expert_cache: auto: %s\n", line.c_str());
        expert_cache_set_auto_line(model, line);
    }
    return run;
}

// shadow= on a recurrent or hybrid model: the recurrent memory's state tensors, which the exact pass's writes are
// undone in (llama-expert-shadow.h)
static void shadow_attach_state(llama_expert_shadow & shadow, const llama_model & model, const llama_memory_i * memory,
        const std::string & prefix) {
    if (!llama_model_is_recurrent(&model) && !llama_model_is_hybrid(&model)) {
        return;
    }
    const llama_memory_recurrent * recr = dynamic_cast<const llama_memory_recurrent *>(memory);
    if (const auto * hybrid = dynamic_cast<const llama_memory_hybrid *>(memory)) {
        recr = hybrid->get_mem_recr();
    }
    if (recr == nullptr) {
        throw std::runtime_error(prefix + "shadow= on a recurrent model needs its recurrent memory, which this context "
            "does not have: remove shadow=");
    }
    for (const auto * v : { &recr->r_l, &recr->s_l }) {
        for (ggml_tensor * t : *v) {
            if (t != nullptr) {
                shadow.state.push_back(t);
            }
        }
    }
}

static std::unique_ptr<llama_expert_cache_impl> expert_cache_create(const llama_model & model, const llama_memory_i * memory,
        const llama_cparams & cparams, const char * spec_env) {
    std::map<ggml_backend_buffer_type_t, size_t> ctx_mem;
    if (memory) {
        ctx_mem = memory->memory_breakdown();
    }
    std::string rest;
    const std::string spec_auto = llama_expert_auto_requested(spec_env, rest) ?
        expert_cache_auto_spec(model, spec_env, rest, ctx_mem, cparams) : std::string();
    const char * spec = spec_auto.empty() ? spec_env : spec_auto.c_str();
    llama_expert_cache_config cfg;
    std::string err;
    if (!llama_expert_cache_config_parse(spec, cfg, err)) {
        throw std::runtime_error(std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + spec + "': " + err);
    }
    if (cfg.mode == LLAMA_EXPERT_CACHE_MODE_OFF) {
        replay_needs_cache(model);
        if (!cfg.off_ignored.empty() && !model.hparams.no_alloc) {
            LLAMA_LOG_WARN("%s: %s='%s': mode=off: the cache is off and %s have no effect\n", __func__,
                LLAMA_EXPERT_CACHE_ENV, spec, cfg.off_ignored.c_str());
        }
        return nullptr;
    }
    auto cache = std::make_unique<llama_expert_cache_impl>(cfg, model, ctx_mem);
    if (cache->shadow) {
        shadow_attach_state(*cache->shadow, model, memory, std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + spec + "': ");
    }
    return cache;
}

// the shape of the model that the cache's policies need (no tensors): a model's, or a router trace's (llama-moe-sim)
static llama_expert_model_shape shape_of(const llama_model & model) {
    const auto & hparams = model.hparams;
    llama_expert_model_shape shape;
    shape.n_layer  = (int32_t) std::max<size_t>(hparams.n_layer(), model.layers.size()); // including MTP/nextn layers
    shape.n_expert = (int32_t) hparams.n_expert;
    shape.n_used   = (int32_t) hparams.n_expert_used_max();
    shape.arch     = llm_arch_name(model.arch);
    shape.dry_run  = hparams.no_alloc;
    shape.moe.resize(shape.n_layer);
    for (int32_t il = 0; il < shape.n_layer; ++il) {
        shape.moe[il] = il < (int32_t) model.layers.size() &&
            (model.layers[il].ffn_down_exps != nullptr || model.layers[il].ffn_gate_up_exps != nullptr);
    }
    return shape;
}

// the shape's experts, the output paths (checked now, not after a long run)
void llama_expert_cache_impl::init_shape(const llama_expert_model_shape & shape, const std::string & prefix) {
    // a memory-fitting dry run (llama.cpp's -fit probe) sizes the cache but never runs: it writes, prints and
    // traces nothing, so that no all-zero statistics file is left looking like the run's
    dry_run = shape.dry_run;
    test_gating = getenv("LLAMA_MOE_CACHE_TEST_GATING") != nullptr;
    if (!dry_run) {
        // the output paths are checked now, not after a long run
        for (const std::string * path : { &cfg.stats, &cfg.profile_out }) {
            if (path->empty()) {
                continue;
            }
            const bool existed = access(path->c_str(), F_OK) == 0;
            FILE * f = fopen(path->c_str(), "a");
            if (f == nullptr) {
                throw std::runtime_error(prefix + (path == &cfg.stats ? "stats=" : "profile_out=") + *path +
                    ": cannot write there (" + strerror(errno) + ")");
            }
            fclose(f);
            if (!existed) {
                remove(path->c_str());
            }
        }
    }

    n_layer  = shape.n_layer;
    n_expert = shape.n_expert;
    n_used   = shape.n_used;
    arch     = shape.arch;

    if (n_expert <= 0 || n_used <= 0) {
        throw std::runtime_error(prefix + "mode=" + llama_expert_cache_mode_name(cfg.mode) +
            " needs a Mixture-of-Experts model, and this model (" + arch + ") has no routed experts");
    }
}

// the slots' checks, the group size, the layers and their policies (initial residency from a profile)
int32_t llama_expert_cache_impl::init_policies(const llama_expert_model_shape & shape, const std::string & prefix) {
    if (n_slots > n_expert) {
        throw std::runtime_error(prefix + "slots=" + std::to_string(n_slots) + " is more than the " +
            std::to_string(n_expert) + " experts per layer");
    }
    if (n_slots < n_used) {
        throw std::runtime_error(prefix + "slots=" + std::to_string(n_slots) + " is fewer than the " +
            std::to_string(n_used) + " experts used per token; give at least " + std::to_string(n_used));
    }
    {
        std::string err;
        if (!llama_expert_cache_config_check_k(cfg, n_used, n_expert, err)) {
            throw std::runtime_error(prefix + err);
        }
    }

    // small multi-token ubatches computed from the banks together: their experts (at most group*k) must fit
    group_max = cfg.group < 0 ? n_slots / n_used : std::min(cfg.group, n_slots / n_used);
    if (cfg.bypass > 0) {
        group_max = std::min<int32_t>(group_max, (int32_t) cfg.bypass - 1);
    }
    group_max = std::max<int32_t>(group_max, 1);

    std::vector<std::vector<uint64_t>> profile;
    if (!cfg.profile.empty()) {
        std::string err;
        if (!llama_expert_profile_read(cfg.profile, profile, err)) {
            throw std::runtime_error(prefix + err);
        }
    }

    int32_t n_moe = 0;
    layers.resize(n_layer);
    for (int32_t il = 0; il < n_layer; ++il) {
        auto L = std::make_unique<llama_expert_cache_layer>();
        L->cache = this;
        L->il    = il;
        L->moe   = shape.moe[il];
        L->policy.init(n_expert, n_slots, cfg);
        if (L->moe && !profile.empty()) {
            if (il >= (int32_t) profile.size() || (int32_t) profile[il].size() != n_expert) {
                throw std::runtime_error(prefix + "profile '" + cfg.profile + "' has no counts for layer " +
                    std::to_string(il) + " with " + std::to_string(n_expert) + " experts");
            }
            L->policy.set_initial(&profile[il]);
        }
        n_moe += L->moe;
        layers[il] = std::move(L);
    }
    return n_moe;
}

llama_expert_cache_impl::llama_expert_cache_impl(const llama_expert_cache_config & cfg_, const llama_model & model,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem) : cfg(cfg_), model(&model) {
    const std::string prefix = std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + cfg.spec + "': ";
    const llama_expert_model_shape shape = shape_of(model);
    init_shape(shape, prefix);
    if (!cfg.trace.empty() && !dry_run) {
        trace_fingerprint = llama_expert_fingerprint_of_model(model); // the trace is opened by init_end
    }
    if (model.arch == LLM_ARCH_GROVEMOE) {
        throw std::runtime_error(prefix + "grovemoe routes two expert sets per layer (ffn_*_exps and ffn_*_chexps), which "
            "the expert cache cannot serve: run it without the cache (unset LLAMA_MOE_CACHE, or mode=off)");
    }

    n_slots = llama_expert_cache_config_n_slots(cfg, n_expert);
    if (cfg.vram > 0 || cfg.ram > 0) {
        n_slots = llama_expert_engine_slots_for_budget(model, shape.moe, n_expert, n_used, cfg.ram > 0 ? cfg.ram : cfg.vram,
            cfg.vram_reserve, ctx_mem, prefix, cfg.ram > 0, cfg.host_file ? cfg.readers : 0,
            cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE, cfg.runtime);
    }
    const int32_t n_moe = init_policies(shape, prefix);
    // prefetch: each MoE layer predicts the next MoE layer with that layer's router
    for (int32_t il = 0, prev = -1; il < n_layer; ++il) {
        if (layers[il]->moe) {
            first_moe = first_moe < 0 ? il : first_moe;
            if (prev >= 0 && il < (int32_t) model.layers.size() && model.layers[il].ffn_gate_inp != nullptr) {
                layers[prev]->next_moe = il;
            }
            prev = il;
        }
    }

    if (cfg.mode == LLAMA_EXPERT_CACHE_MODE_ENGINE) {
        std::vector<bool> moe(n_layer);
        for (int32_t il = 0; il < n_layer; ++il) {
            moe[il] = layers[il]->moe;
        }
        engine = std::make_unique<llama_expert_engine>(model, moe, n_expert, n_slots, cfg.async, prefix.c_str(), cfg.host_file,
                                                       cfg.readers, cfg.direct,
                                                       llama_expert_cache_config_n_ram_slots(cfg, n_expert), cfg.pack);
        // initial fill: the policy's initial residency
        for (int32_t il = 0; il < n_layer; ++il) {
            if (layers[il]->moe) {
                engine->sync(il, layers[il]->policy);
                engine->layers[il].stats_init = engine->layers[il].stats;
            }
        }
        if (engine->failed()) {
            throw std::runtime_error(engine->failure());
        }
        engine->reset_stats();
    }

    init_end(n_moe);
    if (cfg.shadow > 0) {
        if (replay) {
            throw std::runtime_error(prefix + "shadow= compares with the model's own routing, which " +
                LLAMA_EXPERT_REPLAY_ENV + " replaces: remove shadow=");
        }
        shadow = std::make_unique<llama_expert_shadow>(cfg.shadow);
        LLAMA_LOG_INFO("llama_expert_cache: shadow estimate: every %u ubatches, one is also computed exactly and the "
            "two next-token distributions compared\n", cfg.shadow);
    }
    if (!dry_run && (!cfg.stats.empty() || !cfg.profile_out.empty())) {
        // a process that never reaches its end (a llama-server that hangs on SIGTERM under load) still gets them
        llama_expert_writer_add(this);
        writer_added = true;
    }
}

llama_expert_cache_impl::llama_expert_cache_impl(const llama_expert_cache_config & cfg_, const llama_expert_model_shape & shape)
        : cfg(cfg_) {
    const std::string prefix = std::string(LLAMA_EXPERT_CACHE_ENV) + "='" + cfg.spec + "': ";
    if (cfg.mode != LLAMA_EXPERT_CACHE_MODE_EMULATE) {
        throw std::runtime_error(prefix + "a cache without a model decides only: mode=emulate");
    }
    if (cfg.vram > 0 || cfg.ram > 0) {
        throw std::runtime_error(prefix + "vram= and ram= size the residency from a model's memory: give slots= instead");
    }
    init_shape(shape, prefix);
    n_slots = llama_expert_cache_config_n_slots(cfg, n_expert);
    init_end(init_policies(shape, prefix));
}

// the trace, and what the cache says at start
void llama_expert_cache_impl::init_end(int32_t n_moe) {
    const char * who = "llama_expert_cache"; // the log lines' name since they were first written (tests read them)
    trace_top = std::min<uint32_t>(cfg.trace_top, (uint32_t) n_expert);
    if (!cfg.trace.empty() && !dry_run) {
        trace_open();
    }
    const char * replay_path = getenv(LLAMA_EXPERT_REPLAY_ENV);
    if (replay_path != nullptr && replay_path[0] != '\0' && !dry_run) {
        if (cfg.prefetch) {
            throw std::runtime_error(std::string(LLAMA_EXPERT_REPLAY_ENV) + " with prefetch=on: the prediction comes from "
                "the model's own routers, unrelated to the replayed routing; give prefetch=off");
        }
        std::vector<bool> moe(n_layer, false);
        for (int32_t il = 0; il < n_layer; ++il) {
            moe[il] = layers[il]->moe;
        }
        auto r = std::make_unique<llama_expert_replay>();
        std::string err;
        if (!r->load(replay_path, n_expert, n_used, moe, err)) {
            throw std::runtime_error(err);
        }
        replay = std::move(r);
        LLAMA_LOG_WARN("%s: %s\n", who, replay->describe().c_str());
    }

    LLAMA_LOG_INFO("%s: mode = %s, policy = %s (rule = %s, tau = %.3f, evict = %s, admit = %s, beta = %.3f, lfu halving every %u tokens)\n",
        who, llama_expert_cache_mode_name(cfg.mode), cfg.preset.c_str(), llama_expert_miss_rule_name(cfg.rule),
        cfg.tau, llama_expert_evict_name(cfg.evict), cfg.admit ? "on" : "off", cfg.beta, cfg.lfu_halve);
    const std::string rule_line = llama_expert_rule_describe(llama_expert_rule_of(cfg.rule),
        llama_expert_cache_config_params(cfg), n_used, n_expert);
    if (!rule_line.empty()) {
        LLAMA_LOG_INFO("%s: %s\n", who, rule_line.c_str());
    }
    if (cfg.prefetch) {
        LLAMA_LOG_INFO("%s: prefetch: each MoE layer's route step predicts the next MoE layer's experts with that layer's router%s\n",
            who, engine ? "; one-token ubatches copy them in the background" : "");
    }
    if (cfg.evict == LLAMA_EXPERT_EVICT_CLASSLRU) {
        LLAMA_LOG_INFO("%s: classlru: half-life %u tokens, %u classes\n", who, cfg.classlru_half_life, cfg.classlru_classes);
    }
    LLAMA_LOG_INFO("%s: %d of %d experts resident per layer (%.1f%%), %d used per token, %d MoE layers%s%s\n",
        who, n_slots, n_expert, 100.0 * n_slots / n_expert, n_used, n_moe,
        cfg.profile.empty() ? "" : ", initial residency from ", cfg.profile.c_str());
    if (group_max > 1) {
        LLAMA_LOG_INFO("%s: ubatches of 2 to %d tokens are decided as a group (their experts held resident together)%s\n",
            who, group_max, engine ? " and computed from the cache banks" : "");
    }
}

// A statistics, profile or trace file that could not be written at the end of a run (the cache is destroyed with the
// context, after the tool's last word): one line on stderr (the tool's log may be silenced or already drained, as in
// llama-bench), and the process exits with status 1 instead of 0. The exit handler is registered when libllama is
// loaded, before any tool registers its own (common's log drain), so that it runs last, after them.
static std::atomic<bool> g_expert_cache_write_failed{false};

static void expert_cache_exit_handler() {
    if (g_expert_cache_write_failed.load()) {
        fflush(nullptr);
        _exit(EXIT_FAILURE);
    }
}

__attribute__((constructor)) static void expert_cache_register_exit_handler() {
    atexit(expert_cache_exit_handler);
}

static void expert_cache_write_failed(const std::string & spec, const char * key, const std::string & path, int err,
        const char * what) {
    fprintf(stderr, "%s='%s': %s=%s: %s could not be written at the end of the run (%s); the process will exit with "
        "status 1: free space or give another path\n", LLAMA_EXPERT_CACHE_ENV, spec.c_str(), key, path.c_str(), what,
        err ? strerror(err) : "write error");
    fflush(stderr);
    g_expert_cache_write_failed = true;
}

llama_expert_cache_impl::~llama_expert_cache_impl() {
    if (writer_added) {
        llama_expert_writer_remove(this); // waits for a write of this cache's files in progress
    }
    if (dry_run) {
        return;
    }
    print_stats();
    if (!cfg.stats.empty()) {
        errno = 0;
        if (write_stats(cfg.stats)) {
            LLAMA_LOG_INFO("%s: statistics written to %s\n", "~llama_expert_cache", cfg.stats.c_str());
        } else {
            expert_cache_write_failed(cfg.spec, "stats", cfg.stats, errno, "the statistics");
        }
    }
    if (!cfg.profile_out.empty()) {
        errno = 0;
        if (!write_profile(cfg.profile_out)) {
            expert_cache_write_failed(cfg.spec, "profile_out", cfg.profile_out, errno, "the profile");
        }
    }
    if (trace) {
        errno = 0;
        const bool ok = !ferror(trace);
        if (fclose(trace) != 0 || !ok) {
            expert_cache_write_failed(cfg.spec, "trace", cfg.trace, errno, "the router trace");
        }
        trace = nullptr;
    }
}

bool llama_expert_cache_impl::write_profile(const std::string & path) const {
    std::vector<const llama_expert_layer_policy *> ps;
    std::vector<int32_t> ids;
    for (const auto & L : layers) {
        if (L->moe) {
            ps.push_back(&L->policy);
            ids.push_back(L->il);
        }
    }
    return llama_expert_profile_write(path, ps, ids);
}

void llama_expert_cache_impl::write_files_now(const char * why) {
    std::lock_guard<std::mutex> lock(state_mtx);
    std::string done;
    for (const auto & [path, what] : { std::make_pair(&cfg.stats, "statistics"), std::make_pair(&cfg.profile_out, "profile") }) {
        if (path->empty()) {
            continue;
        }
        const bool ok = llama_expert_write_replacing(*path, [this, path = path](const std::string & p) {
            return path == &cfg.stats ? write_stats(p) : write_profile(p);
        });
        if (ok) {
            done += (done.empty() ? "" : ", ") + std::string(what) + " to " + *path;
        } else {
            LLAMA_LOG_WARN("expert cache: on %s: the %s could not be written to %s (%s)\n", why, what, path->c_str(),
                strerror(errno));
        }
    }
    if (!done.empty()) {
        // a warning, so that the default verbosity shows it: the run may not reach its end (its own files' line)
        LLAMA_LOG_WARN("expert cache: on %s: %s written\n", why, done.c_str());
    }
}

void llama_expert_cache_impl::reset() {
    std::lock_guard<std::mutex> lock(state_mtx);
    profile_written_tokens = 0;
    if (engine) {
        // no copy in flight or deferred past this point
        for (auto & L : layers) {
            if (L->moe) {
                engine->complete(L->il, L->policy);
                engine->settle_prefetch(L->il, L->policy);
            }
        }
    }
    if (shadow) {
        shadow->reset();
    }
    for (auto & L : layers) {
        L->policy.reset();
        L->route_ns      = 0;
        L->route_tokens  = 0;
        L->gating_checked   = 0;
        L->gating_ratio_min = 1e300;
        L->gating_ratio_max = -1e300;
        L->bypass_tokens = 0;
        L->pred_tokens   = -1;
    }
    if (engine) {
        // back to the initial residency in the banks too; these copies do not count
        for (auto & L : layers) {
            if (L->moe) {
                engine->sync(L->il, L->policy);
            }
        }
        engine->reset_stats();
    }
    if (trace) {
        fclose(trace);
        trace = nullptr;
        trace_open();
    }
}

//
void llama_expert_cache_impl::chain_abort_callback(bool (*&cb)(void * data), void *& data) {
    if (!engine || (engine->files.empty() && !llama_expert_copy_fault_armed())) {
        return; // only reads from a file (or the copy-failure test hook) fail
    }
    user_abort      = cb;
    user_abort_data = data;
    cb = [](void * p) {
        const auto * cache = (const llama_expert_cache_impl *) p;
        if (cache->engine->failed()) {
            // the failed read or copy was logged where it happened; the process's health check reports it from now
            llama_expert_health_fail(cache->engine->failure());
            return true;
        }
        return cache->user_abort != nullptr && cache->user_abort(cache->user_abort_data);
    };
    data = this;
}

void llama_expert_cache_impl::memory_breakdown_add(llama_memory_breakdown & ret) const {
    if (!engine) {
        return;
    }
    for (const auto & [buft, size] : engine->memory_breakdown()) {
        ret[buft].context += size;
    }
}

bool llama_expert_cache_impl::grouped(int64_t n_tokens) const {
    return n_tokens > 1 && n_tokens <= group_max;
}

bool llama_expert_cache_impl::banked(const ggml_tensor * route) const {
    return engine != nullptr && (route->ne[1] == 1 || grouped(route->ne[1]));
}

ggml_tensor * llama_expert_cache_impl::bank(int il, ggml_tensor * src) const {
    GGML_ASSERT(engine);
    return engine->bank(il, src);
}

