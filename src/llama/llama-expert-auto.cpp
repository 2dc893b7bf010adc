#include "llama-expert-auto.h"

#include "llama-expert-budget.h"
#include "llama-expert-machine.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>

static std::string auto_format(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[2048];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    return buf;
}

static const double MiB = 1024.0*1024.0;

static uint64_t auto_margin(uint64_t bytes) {
    return bytes / 100 * LLAMA_EXPERT_AUTO_MARGIN_PCT;
}

static std::string auto_mib(uint64_t bytes) {
    return std::to_string(bytes >> 20) + "M"; // whole MiB, rounded down: as a user writes a size
}

std::string llama_expert_auto_plan::spec() const {
    if (off) {
        return "mode=off";
    }
    std::string s;
    for (const auto & kv : keys) {
        s += (s.empty() ? "" : ",") + kv.first + "=" + kv.second;
    }
    return s;
}

static uint64_t auto_mib_up(uint64_t bytes) {
    return (bytes + (1ull << 20) - 1) >> 20 << 20;
}

// the estimates in bytes; the public functions round them up to a MiB, as a spec's vram_reserve= is written, and
// whether stock fits is asked with these (the rounding of two terms was half of the estimate's error near the fit)
static uint64_t auto_compute_exact(const llama_expert_auto_model & m) {
    if (m.n_ubatch == 0 || m.n_vocab == 0) {
        return LLAMA_EXPERT_AUTO_RESERVE_UNKNOWN;
    }
    const uint64_t per_token = std::max<uint64_t>(4*(m.n_vocab + 2*m.n_embd),
        16*(uint64_t) std::max(m.k, 0)*m.n_ff_exp + 2ull*m.n_ctx);
    return (uint64_t) m.n_ubatch*per_token/4*5;
}

static uint64_t auto_output_exact(const llama_expert_auto_model & m) {
    return 4*m.n_vocab*(uint64_t) m.n_batch;
}

// what a decode adds to the held memory: a one-token ubatch's compute buffers, the logits reserved at creation (a row
// per sequence) and the runtime's growth (LLAMA_EXPERT_STOCK_DECODE_GROWTH)
static uint64_t auto_decode_exact(const llama_expert_auto_model & m) {
    llama_expert_auto_model one = m;
    one.n_ubatch = 1;
    const uint64_t compute = m.n_vocab == 0 ? 0 : auto_compute_exact(one);
    return compute + 4*m.n_vocab*(uint64_t) std::max<uint32_t>(m.n_seq, 1) + LLAMA_EXPERT_STOCK_DECODE_GROWTH;
}

uint64_t llama_expert_auto_compute_bytes(const llama_expert_auto_model & m) {
    return auto_mib_up(auto_compute_exact(m));
}

uint64_t llama_expert_auto_output_bytes(const llama_expert_auto_model & m) {
    return auto_mib_up(auto_output_exact(m));
}

static llama_expert_auto_plan auto_off(const std::string & why) {
    llama_expert_auto_plan p;
    p.why = why;
    return p;
}

static llama_expert_auto_plan auto_error(const std::string & err) {
    llama_expert_auto_plan p;
    p.err = err;
    return p;
}

// the terms of the decision: the compute buffers and logits, stock's footprint in RAM, what the process may use
struct auto_terms {
    bool        reserve_given;  // the user gave vram_reserve=
    uint64_t    compute;        // the compute buffers (MiB-rounded), or the user's reserve
    uint64_t    output;         // the logits of a batch (MiB-rounded; 0 with the user's reserve)
    std::string reserve_facts;  // the line's words for those two
    uint64_t    host_weights;   // the weights in host memory (a GPU holds the rest)
    uint64_t    host_context;   // the context in host memory
    uint64_t    host_reserve;   // the compute buffers and logits in host memory
    uint64_t    fit_reserve;    // the same in bytes, unrounded, for whether stock fits
    bool        held_known;     // what the process holds is known (and stands for the context and the runtime)
    uint64_t    host_file;      // the host weights and the host experts: the file's part stock maps
    uint64_t    stock_ram;      // stock's estimate in RAM
    std::string with_what;      // the line's words for what the estimate counts
    const char * runtime;       // ", and the runtime" where the fixed runtime is counted
    bool        known;          // the machine's memory is known
    uint64_t    room;           // what the process may use less the margin
    bool        fits_ram;       // stock fits by the estimate
    std::string ram_facts;      // the line's words for the machine
    std::string policy;
    std::string policy_why;
    int32_t     readers;
    uint64_t    usable;
};

static auto_terms auto_terms_of(const llama_expert_auto_model & m, uint64_t usable, const std::string & facts,
        uint64_t reserve, int32_t readers, const std::string & policy, const std::string & policy_why) {
    // the compute buffers and the logits: the user's vram_reserve, or what llama.cpp will allocate for this context
    const bool     reserve_given = reserve > 0;
    const uint64_t compute       = reserve_given ? reserve : llama_expert_auto_compute_bytes(m);
    const uint64_t output        = reserve_given ? 0 : llama_expert_auto_output_bytes(m);
    const std::string reserve_facts = reserve_given ?
        auto_format("vram_reserve=%s given", auto_mib(reserve).c_str()) : m.n_ubatch == 0 ?
        auto_format("%.0f MiB for the compute buffers: the context's sizes are unknown", compute/MiB) :
        auto_format("%.0f MiB for the compute buffers at ubatch %u and %.0f MiB for the logits of a batch of %u",
            compute/MiB, m.n_ubatch, output/MiB, m.n_batch);
    // what the process holds in RAM with the cache off: every weight in host memory (mmap: its pages), the context,
    // the compute buffers, the logits and the runtime; a GPU holds the rest (and its compute buffers)
    const uint64_t host_weights = m.gpu ? (m.weights > m.dev_weights ? m.weights - m.dev_weights : 0) : m.weights;
    const uint64_t host_context = m.gpu ? (m.context > m.dev_context ? m.context - m.dev_context : 0) : m.context;
    const uint64_t host_reserve = m.gpu ? output : compute + output;
    // the same in bytes, unrounded, for whether stock fits
    const uint64_t fit_reserve  = reserve_given ? (m.gpu ? 0 : reserve) :
                                  (m.gpu ? 0 : auto_compute_exact(m)) + auto_output_exact(m);
    // with the process's own memory known, it stands for the context and the runtime (both resident by now); the
    // mapped weights are page cache, counted whole; weights read in (--no-mmap) are in the held memory. A repack makes
    // both (its copy is held, the file's pages may stay cached): the fixed estimate then, which counts the weights once
    const bool     held_known   = m.held > 0 && !m.repacked;
    const uint64_t host_file    = host_weights + (m.experts_host ? m.experts : 0);
    const uint64_t stock_ram    = held_known ? (m.mapped ? host_file : 0) + m.held + fit_reserve :
                                  host_file + host_context + fit_reserve + LLAMA_EXPERT_AUTO_STOCK_BASELINE;
    const std::string with_what = held_known ?
        auto_format("with the %.1f MiB this process holds (its context and runtime)", m.held/MiB) :
        std::string("with its context");
    const char *      runtime   = held_known ? "" : ", and the runtime";
    const bool     known        = usable != UINT64_MAX;
    const uint64_t room         = known ? usable - auto_margin(usable) : UINT64_MAX;
    // stock fits in all the process may use: no margin, which is the file tier's, for the page cache it reads through
    // (studymoe, 92 MiB at its peak, decoded at full speed in a 96 MiB cgroup, where the file tier ran at 0.6x). Where
    // it does not, stock's page cache thrashes: each fault reads ahead up to read_ahead_kb and evicts weights still in
    // use (a random-routing model of 196 MiB, 203 MiB at its peak, in 200 MiB: stock 56-72 t/s at read_ahead_kb 8192,
    // 267 at 128, the file tier 296-531; 2 threads, --repack 0; eval/auto-vs-stock-3)
    const bool     fits_ram     = !known || stock_ram <= usable;
    const std::string ram_facts = known ? auto_format("%.1f MiB this process may use (%s)", usable/MiB,
        facts.c_str()) : "no memory facts (" + facts + ")";
    return { reserve_given, compute, output, reserve_facts, host_weights, host_context, host_reserve, fit_reserve,
        held_known, host_file, stock_ram, with_what, runtime, known, room, fits_ram, ram_facts, policy, policy_why,
        readers, usable };
}

// the file tier's requirements: the experts read from the model file, in their plain layout ("" when met)
static std::string auto_file_tier_refusal(const llama_expert_auto_model & m, const char * what) {
    if (m.repacked) {
        return auto_format("auto: %s needs the file tier, whose experts must be in their plain layout, but they "
            "were repacked for the CPU: add --no-repack (-nr)", what);
    }
    if (!m.mapped) {
        return auto_format("auto: %s needs the file tier, which reads the experts from the model file, but the "
            "model was loaded without mmap: load it with mmap (drop --no-mmap, or --load-mode none)", what);
    }
    return "";
}

// a CPU machine: off where stock fits (or measured to, near the fit), else the file tier
static llama_expert_auto_plan auto_decide_cpu(const llama_expert_auto_model & m, const auto_terms & t) {
    const auto & [reserve_given, compute, output, reserve_facts, host_weights, host_context, host_reserve, fit_reserve,
        held_known, host_file, stock_ram, with_what, runtime, known, room, fits_ram, ram_facts, policy, policy_why,
        readers, usable] = t;
    if (fits_ram) {
        return auto_off(auto_format("the model (%.1f MiB %s, %s%s) fits in the %s: stock is as fast",
            stock_ram/MiB, with_what.c_str(), reserve_facts.c_str(), runtime, ram_facts.c_str()));
    }
    // near the fit: the mapped weights fit beside what the process holds, and the estimate's compute buffers and
    // logits (a whole ubatch, a whole batch's outputs, which a decode does not touch) do not. The estimate cannot
    // say there whether stock decodes at full speed or thrashes (studymoe in 92 MiB: stock 776 t/s, the file tier
    // 0.66x; in 88 MiB, below the band: stock 26 t/s, the file tier 18x): measured, where the caller can
    const bool near_band = held_known && m.mapped && known && host_file + m.held <= usable;
    if (near_band && m.stock_fits == 1) {
        return auto_off(auto_format("the model (%.1f MiB %s, %s) is above the %s by its estimate, but measured, "
            "all %.1f MiB of its mapped weights stayed resident, touched once beside what the process holds and "
            "%.1f MiB for a decode: stock is as fast (a tool that asks for every token's logits, as "
            "llama-perplexity, may thrash its page cache there, as stock's would)", stock_ram/MiB,
            with_what.c_str(), reserve_facts.c_str(), ram_facts.c_str(), m.stock_touched/MiB,
            auto_decode_exact(m)/MiB));
    }
    const std::string measured = near_band && m.stock_fits == 0 ? auto_format("; measured, %.1f of its %.1f MiB "
        "of mapped weights stayed resident when touched once", m.stock_resident/MiB, m.stock_touched/MiB) : "";
    const std::string what = auto_format("the model (%.1f MiB %s, %s%s) is more than the %s%s, so it",
        stock_ram/MiB, with_what.c_str(), reserve_facts.c_str(), runtime, ram_facts.c_str(),
        measured.empty() ? "" : measured.c_str());
    // near the fit: the model file fits in what the process may use, and only the context, compute buffers and
    // runtime do not. The file tier is faster there where it can run (above); where it cannot (a repacked or
    // unmapped model) stock still runs, from the page cache: auto does not refuse it, the line says what the file
    // tier needs and the command that measures both
    const uint64_t file_bytes = host_weights + m.experts;
    const std::string refusal = auto_file_tier_refusal(m, what.c_str());
    const bool     near_fit   = !refusal.empty() && known && file_bytes <= usable;
    if (!refusal.empty() && !near_fit) {
        return auto_error(refusal);
    }
    llama_expert_budget b;
    b.ram      = true;
    b.budget   = room >> 20 << 20;
    b.weights  = m.weights;
    b.context  = m.context;
    b.reserve  = compute + output;
    b.readers  = readers > 0 ? (uint64_t) (readers + 1) * (m.max_slice + 2*4096) : 0;
    // what the process holds (the runtime, the vocabulary) and its growth, where known, in place of the fixed
    // baseline (48 MiB, twice a small model's measured peak): studymoe holds 6.5 MiB with its context. Not for an
    // unmapped model (the weights read in are in the held memory; the file tier needs mmap anyway)
    const bool runtime_known = held_known && m.mapped;
    b.baseline = runtime_known ? auto_mib_up(llama_expert_runtime_baseline(m.held, m.context)) :
                                 LLAMA_EXPERT_RUNTIME_BASELINE; // whole MiB: the plan's runtime= is written so
    b.per_slot = m.per_slot;
    b.n_banks  = m.n_banks;
    b.n_expert = m.n_expert;
    b.k        = m.k;
    std::string err;
    const int32_t n = llama_expert_budget_slots(b, err);
    if (n < 0) {
        // not even k slots fit: the cache cannot help, and stock, whose weights stay in the (reclaimable) page
        // cache, may still run where this estimate of the compute buffers and logits is above what the tool
        // uses (a batch that asks for fewer logits): run stock, saying so, never refuse what stock would run
        return auto_off(auto_format("%s would need the file tier, and even that needs at least %.0f MiB (%d "
            "experts per layer resident): the cache cannot fit, so the model runs stock, from the page cache (slow "
            "when it does not fit, and killed if the compute buffers do not: free memory, raise the memory limit, "
            "or a smaller ubatch and batch, -ub and -b; the compute buffers and logits are vram_reserve=%s here)",
            what.c_str(), b.minimum()/MiB + 1, m.k, auto_mib(compute + output).c_str()));
    }
    llama_expert_auto_plan p;
    p.off   = false;
    p.slots = n;
    p.runtime = runtime_known ? b.baseline : 0;
    p.keys  = { {"mode", "engine"}, {"policy", policy}, {"host", "file"}, {"ram", auto_mib(b.budget)} };
    if (runtime_known) {
        p.keys.emplace_back("runtime", auto_mib(b.baseline));
    }
    if (!reserve_given) {
        p.keys.emplace_back("vram_reserve", auto_mib(compute + output));
    }
    p.policy_why = policy_why;
    if (near_fit) {
        return auto_off(auto_format("near the fit: the model file (%.1f MiB) fits in the %s, and %s, %s%s "
            "(%.1f MiB) it does not, so it would need the file tier (%d of %d experts per layer in RAM: --moe-cache "
            "%s), which needs --no-repack (-nr) and mmap: the model runs stock, from the page cache, which thrashes "
            "when squeezed; `harness compare --ram %s` measures both", file_bytes/MiB, ram_facts.c_str(),
            with_what.c_str(), reserve_facts.c_str(), runtime, stock_ram/MiB, n, m.n_expert, p.spec().c_str(),
            auto_mib(usable).c_str()));
    }
    p.why   = auto_format("%s runs from the file tier: %d of %d experts per layer resident in RAM (ram= that less "
        "a %d%% margin), the rest read from the model file; %s", what.c_str(), n, m.n_expert,
        LLAMA_EXPERT_AUTO_MARGIN_PCT, policy_why.c_str());
    p.unsure  = near_band && m.stock_fits < 0;
    p.ballast = p.unsure ? auto_decode_exact(m) : 0;
    return p;
}

// a GPU holds the MoE layers: the VRAM cache, with a RAM tier and the file where RAM does not hold the experts
static llama_expert_auto_plan auto_decide_gpu(const llama_expert_auto_model & m, const auto_terms & t) {
    const auto & [reserve_given, compute, output, reserve_facts, host_weights, host_context, host_reserve, fit_reserve,
        held_known, host_file, stock_ram, with_what, runtime, known, room, fits_ram, ram_facts, policy, policy_why,
        readers, usable] = t;
    if (!m.experts_host) {
        return auto_off("the routed experts are on the GPU with the rest of the model: stock is as fast");
    }
    // the VRAM cache: the device's room (its free memory and what of ours it holds) less the margin
    const uint64_t dev_room = m.dev_free + m.dev_weights + m.dev_context;
    llama_expert_budget v;
    v.budget   = (dev_room - auto_margin(dev_room)) >> 20 << 20;
    v.weights  = m.dev_weights;
    v.context  = m.dev_context;
    v.reserve  = compute;
    v.per_slot = m.per_slot;
    v.n_banks  = m.n_banks;
    v.n_expert = m.n_expert;
    v.k        = m.k;
    std::string err;
    const int32_t n = llama_expert_budget_slots(v, err);
    if (n < 0) {
        return auto_off(auto_format("the GPU has room for fewer than the %d experts per layer used per token (%.1f MiB "
            "free, the cache needs %.0f MiB): the cache cannot help, the experts stay where stock puts them", m.k,
            m.dev_free/MiB, v.minimum()/MiB + 1));
    }
    llama_expert_auto_plan p;
    p.off   = false;
    p.slots = n;
    p.keys  = { {"mode", "engine"}, {"policy", policy}, {"vram", auto_mib(v.budget)} };
    if (!reserve_given) {
        p.keys.emplace_back("vram_reserve", auto_mib(compute));
    }
    p.policy_why = policy_why;
    if (fits_ram) {
        p.why = auto_format("the experts are in host memory (%.1f MiB, which fits in the %s): the VRAM cache, %d of %d "
            "experts per layer on the GPU (vram= from %.1f MiB of room less a %d%% margin); %s", m.experts/MiB,
            ram_facts.c_str(), n, m.n_expert, dev_room/MiB, LLAMA_EXPERT_AUTO_MARGIN_PCT, policy_why.c_str());
        return p;
    }
    // three tiers: the slots on the GPU, a RAM tier in what RAM holds, the rest read from the file
    const std::string what = auto_format("the model's host part (%.1f MiB with its context and runtime) is more than "
        "the %s, so it", stock_ram/MiB, ram_facts.c_str());
    const std::string refusal = auto_file_tier_refusal(m, what.c_str());
    if (!refusal.empty()) {
        return auto_error(refusal);
    }
    const uint64_t readers_b = readers > 0 ? (uint64_t) (readers + 1) * (m.max_slice + 2*4096) : 0;
    // the runtime: what the process holds less its host context, plus growth, where known (a GPU's runtime holds more
    // host memory than a CPU build's: it is counted as held, not as the fixed 48 MiB)
    const uint64_t runtime_b = held_known && m.mapped ? llama_expert_runtime_baseline(m.held, host_context) :
                                                         LLAMA_EXPERT_RUNTIME_BASELINE;
    const uint64_t own = host_weights + host_context + host_reserve + readers_b + runtime_b;
    const int64_t n_ram = room > own ? (int64_t) std::min<uint64_t>((room - own) / m.per_slot, (uint64_t) m.n_expert) : 0;
    if (n_ram < m.k) {
        return auto_error(auto_format("auto: %s needs three tiers, and RAM has room for fewer than the %d experts per "
            "layer used per token: free memory or raise the memory limit", what.c_str(), m.k));
    }
    p.keys.emplace_back("host", "file");
    p.keys.emplace_back("ram_slots", std::to_string(n_ram));
    p.why = auto_format("%s runs from three tiers: %d of %d experts per layer on the GPU, %d in RAM, the rest read from "
        "the model file; %s", what.c_str(), n, m.n_expert, (int) n_ram, policy_why.c_str());
    return p;
}

llama_expert_auto_plan llama_expert_auto_decide(const llama_expert_auto_model & m, uint64_t usable,
        const std::string & facts, uint64_t reserve, int32_t readers, const std::string & policy_in,
        bool policy_given) {
    const std::string policy = policy_in.empty() ? "quality" : policy_in;
    const std::string policy_why = policy_in.empty() ? "policy quality (no tuned profile)" :
        "policy " + policy + (policy_given ? " (given)" : " (the tuned profile's)");
    if (m.n_expert <= 0 || m.k <= 0 || m.per_slot == 0) {
        return auto_off("the model has no routed experts: the cache has nothing to hold");
    }
    if (!m.remote.empty()) {
        return auto_off("MoE layers are on " + m.remote + ", a device reached over the network (ggml-rpc): the cache "
            "serves local layers only, so the model runs stock");
    }

    const auto_terms t = auto_terms_of(m, usable, facts, reserve, readers, policy, policy_why);
    return m.gpu ? auto_decide_gpu(m, t) : auto_decide_cpu(m, t);
}

bool llama_expert_auto_requested(const std::string & spec, std::string & rest) {
    size_t b = 0;
    while (b < spec.size() && (spec[b] == ' ' || spec[b] == '\t')) {
        b++;
    }
    if (spec.compare(b, 4, "auto") != 0) {
        return false;
    }
    size_t e = b + 4;
    while (e < spec.size() && (spec[e] == ' ' || spec[e] == '\t')) {
        e++;
    }
    if (e == spec.size()) {
        rest.clear();
        return true;
    }
    if (spec[e] != ',') {
        return false;
    }
    rest = spec.substr(e + 1);
    return true;
}

static std::string auto_key_of(const std::string & item) {
    std::string k = item.substr(0, item.find('='));
    while (!k.empty() && (k.front() == ' ' || k.front() == '\t')) { k.erase(k.begin()); }
    while (!k.empty() && (k.back() == ' ' || k.back() == '\t'))   { k.pop_back(); }
    return k;
}

static std::vector<std::string> auto_items(const std::string & rest) {
    std::vector<std::string> items;
    size_t pos = 0;
    while (!rest.empty() && pos <= rest.size()) {
        size_t end = rest.find(',', pos);
        if (end == std::string::npos) {
            end = rest.size();
        }
        items.push_back(rest.substr(pos, end - pos));
        pos = end + 1;
    }
    return items;
}

bool llama_expert_auto_user_gives(const std::string & rest, const std::string & key) {
    for (const auto & u : auto_items(rest)) {
        if (auto_key_of(u) == key) {
            return true;
        }
    }
    return false;
}

std::string llama_expert_auto_user_items(const std::string & rest, const std::vector<std::string> & keys) {
    std::string s;
    for (const auto & u : auto_items(rest)) {
        if (std::find(keys.begin(), keys.end(), auto_key_of(u)) != keys.end()) {
            s += (s.empty() ? "" : ",") + u;
        }
    }
    return s;
}

std::string llama_expert_auto_spec(const llama_expert_auto_plan & plan, const std::string & rest) {
    const std::vector<std::string> user = auto_items(rest);
    if (plan.off) {
        // the user's mode= runs their keys as given (the cache on where auto would leave it off)
        if (llama_expert_auto_user_gives(rest, "mode")) {
            return rest;
        }
        return rest.empty() ? "mode=off" : "mode=off," + rest;
    }
    // the user's slots= fixes the residency: the plan's budget keys, which would compute another, give way
    const bool user_slots = llama_expert_auto_user_gives(rest, "slots");
    std::string s;
    for (const auto & kv : plan.keys) {
        if (user_slots && (kv.first == "ram" || kv.first == "vram")) {
            continue;
        }
        if (!llama_expert_auto_user_gives(rest, kv.first)) {
            s += (s.empty() ? "" : ",") + kv.first + "=" + kv.second;
        }
    }
    for (const auto & u : user) {
        s += (s.empty() ? "" : ",") + u;
    }
    return s;
}

void llama_expert_auto_set_policy(llama_expert_auto_plan & plan, const std::string & policy,
        const std::string & policy_why) {
    if (plan.off || !plan.err.empty()) {
        return;
    }
    if (!plan.policy_why.empty() && plan.why.size() >= plan.policy_why.size() &&
            plan.why.compare(plan.why.size() - plan.policy_why.size(), std::string::npos, plan.policy_why) == 0) {
        plan.why = plan.why.substr(0, plan.why.size() - plan.policy_why.size()) + policy_why;
    } else {
        plan.why += "; " + policy_why;
    }
    plan.policy_why = policy_why;
    if (policy.empty()) {
        return;
    }
    std::vector<std::pair<std::string, std::string>> keys;
    for (const auto & kv : plan.keys) {
        if (kv.first != "policy") {
            keys.push_back(kv);
            continue;
        }
        for (const std::string & item : auto_items(policy)) {
            const size_t eq = item.find('=');
            keys.emplace_back(auto_key_of(item), eq == std::string::npos ? "" : item.substr(eq + 1));
        }
    }
    plan.keys = keys;
}

std::string llama_expert_auto_overridden(const llama_expert_auto_plan & plan, const std::string & rest) {
    std::string s;
    for (const auto & kv : plan.keys) {
        if (llama_expert_auto_user_gives(rest, kv.first) ||
                (llama_expert_auto_user_gives(rest, "slots") && (kv.first == "ram" || kv.first == "vram"))) {
            s += (s.empty() ? "" : ",") + kv.first + "=" + kv.second;
        }
    }
    return s;
}
