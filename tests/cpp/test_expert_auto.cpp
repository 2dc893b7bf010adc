// Unit tests of `--moe-cache auto`'s decision (src/llama/llama-expert-auto.cpp): fake model and machine facts in,
// plans out. Built and run by tests/test_machine.py with the model-free sources (MOE_SUBST_POLICY_SOURCES).
#include "llama-expert-auto.h"
#include "llama-expert-machine.h"
#include "llama-expert-spec.h"

#include <cstdint>
#include <cstdio>
#include <string>

static int n_fail = 0;

#define CHECK(cond) do { if (!(cond)) { std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); ++n_fail; } } while (0)

static const uint64_t MiB = 1ull << 20;
static const uint64_t GiB = 1ull << 30;
static const uint64_t RESERVE = 256*MiB;

// a 30B-A3B-like model: 48 layers x 128 experts, k = 8, 16.5 GiB of experts, 1.5 GiB of the rest
static llama_expert_auto_model big_model() {
    llama_expert_auto_model m;
    m.n_expert  = 128;
    m.k         = 8;
    m.weights   = 1536*MiB;
    m.per_slot  = 132*MiB;              // one expert in each of 48 layers (3 tensors)
    m.experts   = m.per_slot * 128;     // 16.5 GiB
    m.n_banks   = 48*3;
    m.max_slice = 1*MiB;
    m.context   = 384*MiB;
    return m;
}

static bool has(const std::string & s, const std::string & part) {
    return s.find(part) != std::string::npos;
}

static bool parses(const std::string & spec) {
    llama_expert_cache_config cfg;
    std::string err;
    const bool ok = llama_expert_cache_config_parse(spec, cfg, err);
    if (!ok) {
        std::fprintf(stderr, "'%s': %s\n", spec.c_str(), err.c_str());
    }
    return ok;
}

static void test_cpu_plans() {
    const llama_expert_auto_model m = big_model();
    // fits in RAM (64 GiB machine): off, and says why
    llama_expert_auto_plan p = llama_expert_auto_decide(m, 64*GiB, "MemAvailable 64 GiB", RESERVE, 4, "");
    CHECK(p.off && p.err.empty() && p.spec() == "mode=off");
    CHECK(has(p.why, "fits in the") && has(p.why, "stock is as fast") && has(p.why, "MemAvailable 64 GiB"));

    // bigger than RAM (a 16 GiB cgroup): the file tier, ram= from the limit less 10%, policy quality
    p = llama_expert_auto_decide(m, 16*GiB, "the memory cgroup /x", RESERVE, 4, "");
    CHECK(!p.off && p.err.empty());
    // 16 GiB less 10% = 14745.6 MiB -> 14745M; fixed = 1536 + 384 + 256 + 5 x (1 MiB + 8 KiB) + 48 + 132 + 72 KiB
    CHECK(p.spec() == "mode=engine,policy=quality,host=file,ram=14745M");
    CHECK(p.slots == (int32_t) ((14745*MiB - (2356*MiB + 5*(MiB + 8192) + 144*512)) / (132*MiB)));
    CHECK(p.slots == 93);
    CHECK(has(p.why, "runs from the file tier: 93 of 128 experts per layer resident in RAM"));
    CHECK(has(p.why, "policy quality (no tuned profile)") && has(p.why, "the memory cgroup /x"));
    CHECK(parses(p.spec()));
    // a tuned profile's policy is used and named
    p = llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "speed");
    CHECK(has(p.spec(), "policy=speed") && has(p.why, "policy speed (the tuned profile's)"));

    // the same machine facts give the same plan (reproducible)
    CHECK(llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "").spec() ==
          llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "").spec());

    // a tiny limit: stock (never refused where stock may run from the page cache), the line saying what is needed
    p = llama_expert_auto_decide(m, 2*GiB, "the memory cgroup /tiny", RESERVE, 4, "");
    CHECK(p.off && p.err.empty() && p.why.find("the model") == 0 && has(p.why, "runs stock"));
    CHECK(has(p.why, "even that needs at least") && has(p.why, "free memory, raise the memory limit"));
    CHECK(p.why.find('\n') == std::string::npos);

    // repacked experts, or no mmap: the file tier cannot run; one line naming the flag
    llama_expert_auto_model r = m;
    r.repacked = true;
    p = llama_expert_auto_decide(r, 16*GiB, "x", RESERVE, 4, "");
    CHECK(!p.err.empty() && has(p.err, "add --no-repack (-nr)"));
    r = m;
    r.mapped = false;
    p = llama_expert_auto_decide(r, 16*GiB, "x", RESERVE, 4, "");
    CHECK(!p.err.empty() && has(p.err, "load it with mmap"));
    // ... but a model that fits needs neither: off
    r.repacked = true;
    CHECK(llama_expert_auto_decide(r, 64*GiB, "x", RESERVE, 4, "").off);

    // no memory facts: nothing says the model is bigger than RAM: off
    p = llama_expert_auto_decide(m, UINT64_MAX, "no memory facts", RESERVE, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "no memory facts"));

    // not a MoE model
    llama_expert_auto_model dense;
    p = llama_expert_auto_decide(dense, 16*GiB, "x", RESERVE, 4, "");
    CHECK(p.off && has(p.why, "no routed experts"));
}

static void test_gpu_plans() {
    llama_expert_auto_model m = big_model();
    m.gpu         = true;
    m.dev_weights = 1536*MiB;
    m.dev_context = 384*MiB;
    m.dev_free    = 20*GiB;
    // the experts on the GPU with the rest (no --cpu-moe): off
    m.experts_host = false;
    llama_expert_auto_plan p = llama_expert_auto_decide(m, 64*GiB, "x", RESERVE, 4, "");
    CHECK(p.off && has(p.why, "on the GPU with the rest"));
    // experts in host memory, which holds them: the VRAM cache, vram= from the device's room less 10%
    m.experts_host = true;
    m.dev_free     = 4*GiB;
    p = llama_expert_auto_decide(m, 64*GiB, "x", RESERVE, 4, "");
    // room = 4096 + 1536 + 384 = 6016 MiB, less 10% = 5414.4 -> 5414M; (5414 - 2176 - 132 - 72 KiB) / 132 = 23.5
    CHECK(p.spec() == "mode=engine,policy=quality,vram=5414M" && p.slots == 23);
    CHECK(has(p.why, "the VRAM cache, 23 of 128 experts per layer on the GPU"));
    CHECK(parses(p.spec()));
    // ... and RAM does not hold them (a 12 GiB machine): three tiers
    p = llama_expert_auto_decide(m, 12*GiB, "x", RESERVE, 4, "");
    CHECK(has(p.spec(), "mode=engine,policy=quality,vram=5414M,host=file,ram_slots="));
    // RAM room: 12 GiB less 10% = 11059.2 MiB, less 48 MiB baseline and 5 reader buffers: 83 experts of 132 MiB
    CHECK(has(p.spec(), "ram_slots=83") && has(p.why, "three tiers: 23 of 128 experts per layer on the GPU, 83 in RAM"));
    CHECK(parses(p.spec()));
    // what the process holds known (600 MiB: a GPU runtime's host memory), counted in place of the 48 MiB, with 8 MiB
    // of growth: (11059.2 - 5.04 - 608) / 132 = 79.1 -> 79
    llama_expert_auto_model h = m;
    h.held = 600*MiB;
    p = llama_expert_auto_decide(h, 12*GiB, "x", RESERVE, 4, "");
    CHECK(has(p.spec(), "ram_slots=79") && parses(p.spec()));
    // a GPU too small for k slots: off, saying the cache cannot help
    m.dev_free = 0;
    m.dev_weights = 2000*MiB;
    m.dev_context = 0;
    p = llama_expert_auto_decide(m, 64*GiB, "x", RESERVE, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "the cache cannot help"));
}

static void test_spec_composition() {
    std::string rest;
    CHECK(llama_expert_auto_requested("auto", rest) && rest.empty());
    CHECK(llama_expert_auto_requested(" auto ", rest) && rest.empty());
    CHECK(llama_expert_auto_requested("auto,stats=s.json", rest) && rest == "stats=s.json");
    CHECK(!llama_expert_auto_requested("autox", rest));
    CHECK(!llama_expert_auto_requested("mode=engine", rest));
    CHECK(!llama_expert_auto_requested("", rest));

    llama_expert_auto_plan p = llama_expert_auto_decide(big_model(), 16*GiB, "x", RESERVE, 4, "");
    CHECK(llama_expert_auto_spec(p, "") == "mode=engine,policy=quality,host=file,ram=14745M");
    // the user's keys win over the plan's, and are added after it
    CHECK(llama_expert_auto_spec(p, "policy=speed,stats=s.json") ==
          "mode=engine,host=file,ram=14745M,policy=speed,stats=s.json");
    CHECK(parses(llama_expert_auto_spec(p, "policy=speed,stats=s.json")));
    // an off plan stays off (the parser warns that the user's keys have no effect)
    p = llama_expert_auto_decide(big_model(), 64*GiB, "x", RESERVE, 4, "");
    CHECK(llama_expert_auto_spec(p, "") == "mode=off" && llama_expert_auto_spec(p, "stats=s") == "mode=off,stats=s");
    CHECK(llama_expert_auto_user_gives("stats=s, policy = speed", "policy"));
    CHECK(!llama_expert_auto_user_gives("stats=policy", "policy") && !llama_expert_auto_user_gives("", "policy"));
    p = llama_expert_auto_decide(big_model(), 16*GiB, "x", RESERVE, 4, "speed", true);
    CHECK(has(p.why, "policy speed (given)"));
}

// a tuned profile's policy in place of quality (llama-expert-tuned.h chooses it; tests/test_tuned.py checks the choice)
static void test_tuned_policy() {
    llama_expert_auto_plan p = llama_expert_auto_decide(big_model(), 16*GiB, "x", RESERVE, 4, "");
    const std::string head = p.why.substr(0, p.why.size() - p.policy_why.size());
    CHECK(p.policy_why == "policy quality (no tuned profile)" && has(p.why, p.policy_why));
    llama_expert_auto_set_policy(p, "rule=zero,tau=0.3,evict=lfu,admit=off,prefetch=on", "policy rule=zero,... (tuned x)");
    CHECK(p.spec() == "mode=engine,rule=zero,tau=0.3,evict=lfu,admit=off,prefetch=on,host=file,ram=14745M");
    CHECK(p.why == head + "policy rule=zero,... (tuned x)" && p.slots == 93);
    CHECK(parses(p.spec()));
    // the user's key overrides a tuned one of the same name
    CHECK(llama_expert_auto_spec(p, "tau=0.1") ==
          "mode=engine,rule=zero,evict=lfu,admit=off,prefetch=on,host=file,ram=14745M,tau=0.1");
    // no policy (a profile not used): the keys stay, the reason changes
    p = llama_expert_auto_decide(big_model(), 16*GiB, "x", RESERVE, 4, "");
    llama_expert_auto_set_policy(p, "", "policy quality (the tuned profile t.json is damaged: x)");
    CHECK(p.spec() == "mode=engine,policy=quality,host=file,ram=14745M");
    CHECK(p.why == head + "policy quality (the tuned profile t.json is damaged: x)");
    // the keys the decision reads, without the others
    CHECK(llama_expert_auto_user_items("tau=0.2, vram_reserve=16M,stats=s,policy=speed", {"vram_reserve", "policy"}) ==
          " vram_reserve=16M,policy=speed");
    CHECK(llama_expert_auto_user_items("", {"policy"}).empty() && llama_expert_auto_user_items("tau=1", {"policy"}).empty());
    // an off plan is left alone
    p = llama_expert_auto_decide(big_model(), 64*GiB, "x", RESERVE, 4, "");
    const std::string why = p.why;
    llama_expert_auto_set_policy(p, "rule=zero", "policy rule=zero (tuned)");
    CHECK(p.off && p.spec() == "mode=off" && p.why == why);
}

// MoE layers on a remote device (ggml-rpc): off, naming it, whatever the memory says
static void test_remote_layers() {
    llama_expert_auto_model m = big_model();
    m.gpu = true;
    m.remote = "RPC0 (127.0.0.1:50052)";
    m.dev_free = 64*GiB;
    llama_expert_auto_plan p = llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "RPC0 (127.0.0.1:50052)") && has(p.why, "runs stock"));
    m.remote.clear();
    p = llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "");
    CHECK(!p.off);
}

// the compute buffers and logits from the context's sizes (issue 35): the pin's measured fit x 1.25, the logits of a
// whole batch; the plan writes the sum as vram_reserve= (or the user's), and a refusal names it
static void test_compute_estimate() {
    llama_expert_auto_model m;
    m.n_expert = 512; m.k = 10; m.n_vocab = 2048; m.n_embd = 256; m.n_ff_exp = 128; m.n_ctx = 2048;
    m.per_slot = 6*3*128*256; m.experts = m.per_slot*512; m.n_banks = 18; m.max_slice = 32768; m.weights = 10*MiB;
    CHECK(llama_expert_auto_compute_bytes(m) == RESERVE); // sizes unknown: the spec's default
    m.n_ubatch = 512; m.n_batch = 2048;
    // per token max(4 x (2048 + 512), 16 x 10 x 128 + 4096) = max(10240, 24576) = 24576; x 512 x 1.25 = 15 MiB
    CHECK(llama_expert_auto_compute_bytes(m) == 15*MiB);
    CHECK(llama_expert_auto_output_bytes(m) == 16*MiB);  // 4 x 2048 x 2048
    m.n_ubatch = 2048;
    CHECK(llama_expert_auto_compute_bytes(m) == 60*MiB);
    // a 152k vocabulary: the logits term wins (4 x (151936 + 2 x 2048) x 512 x 1.25)
    llama_expert_auto_model q = m;
    q.n_vocab = 151936; q.n_embd = 2048; q.n_ubatch = 512; q.n_ff_exp = 512;
    CHECK(llama_expert_auto_compute_bytes(q) == (uint64_t) ((4ull*(151936 + 4096)*512/4*5 + MiB - 1) / MiB * MiB));

    // a model (377 MiB with everything) that fits in 450 MiB with its real compute buffers: off, where the fixed 256 MiB refused it
    m.n_ubatch = 512;
    llama_expert_auto_plan p = llama_expert_auto_decide(m, 450*MiB, "cg", 0, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "15 MiB for the compute buffers at ubatch 512"));
    CHECK(has(p.why, "16 MiB for the logits of a batch of 2048"));
    // the old fixed reserve in the same limit: the file (298 MiB) fits and the rest does not: the file tier
    p = llama_expert_auto_decide(m, 450*MiB, "cg", RESERVE, 4, "");
    CHECK(!p.off && p.err.empty() && p.spec() == "mode=engine,policy=quality,host=file,ram=405M");
    // bigger than the limit: the file tier, the estimate written as vram_reserve=
    p = llama_expert_auto_decide(m, 200*MiB, "cg", 0, 4, "");
    CHECK(!p.off && p.err.empty() && has(p.spec(), ",vram_reserve=31M") && parses(p.spec()));
    // the user's vram_reserve= is theirs: not written again, and counted instead of the estimate
    p = llama_expert_auto_decide(m, 200*MiB, "cg", 16*MiB, 4, "");
    CHECK(!p.off && !has(p.spec(), "vram_reserve") && has(p.why, "vram_reserve=16M given"));
    // too small for k slots: stock, the line naming the reserve and the flags that shrink it
    p = llama_expert_auto_decide(m, 40*MiB, "cg", 0, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "vram_reserve=31M") && has(p.why, "-ub") && has(p.why, "runs stock"));
}

// near the fit (issue 35): the model file fits in what the process may use, the model with its context and compute
// buffers does not. Stock's page cache thrashes there (a random-routing model of 196 MiB in 200 MiB: the file tier 8x
// stock at read_ahead_kb 8192, 2x at 128; eval/auto-vs-stock-3), so the file tier runs where it can; whether stock
// fits is asked with what the process holds already (held) where it is known, in place of a fixed runtime estimate
static std::string auto_test_mib(uint64_t bytes) {
    char buf[32];
    snprintf(buf, sizeof(buf), "(%.1f", bytes / (1024.0*1024.0));
    return buf;
}

static void test_near_the_fit() {
    llama_expert_auto_model m;
    m.n_expert = 512; m.k = 10; m.n_vocab = 8192; m.n_embd = 256; m.n_ff_exp = 32; m.n_ctx = 512;
    m.n_ubatch = 8; m.n_batch = 8;  // a decode's (llama-bench -n): 1 MiB of compute buffers, 1 MiB of logits
    m.per_slot = 6*3*32*256 + 6*3*32*34; m.experts = m.per_slot*512; m.n_banks = 18; m.max_slice = 8704;
    m.weights = 7*MiB; m.context = 2*MiB;
    const uint64_t file = m.weights + m.experts;
    // held unknown: the fixed runtime (24 MiB) counted; 10 MiB above the file is short of that: the file tier
    llama_expert_auto_plan p = llama_expert_auto_decide(m, file + 10*MiB, "cg", 0, 4, "");
    CHECK(!p.off && p.err.empty() && has(p.why, "runs from the file tier") && has(p.why, "and the runtime)"));
    CHECK(has(p.spec(), "host=file,ram=") && parses(p.spec()));
    // held known (6 MiB: the context and runtime in it): the file, 6 MiB and 2 MiB of compute buffers and logits fit
    // in 10 MiB above the file: stock, the line naming what the process holds
    llama_expert_auto_model h = m;
    h.held = 6*MiB;
    p = llama_expert_auto_decide(h, file + 10*MiB, "cg", 0, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "stock is as fast") && has(p.why, "6.0 MiB this process holds"));
    CHECK(!has(p.why, "and the runtime)"));
    // ... and 3 MiB above the file (gen194 in 200 MiB: the file 196 MiB fits, stock's peak 203 does not): the file tier
    p = llama_expert_auto_decide(h, file + 3*MiB, "cg", 0, 4, "");
    CHECK(!p.off && p.err.empty() && has(p.why, "runs from the file tier") && has(p.why, "this process holds"));
    // below the file: the file tier, as before
    p = llama_expert_auto_decide(m, file - 10*MiB, "cg", 0, 4, "");
    CHECK(!p.off && p.err.empty() && has(p.why, "runs from the file tier"));
    // everything fits: off, stock is as fast
    p = llama_expert_auto_decide(m, file + 200*MiB, "cg", 0, 4, "");
    CHECK(p.off && has(p.why, "stock is as fast") && !has(p.why, "near the fit"));
    // near the fit, a repacked or unmapped model is not refused (stock runs it); the line says what the file tier
    // needs, gives its spec (which parses) and the command that measures both
    llama_expert_auto_model r = m;
    r.repacked = true;
    p = llama_expert_auto_decide(r, file + 10*MiB, "cg", 0, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "near the fit") && has(p.why, "--no-repack") && has(p.why, "runs stock"));
    CHECK(has(p.why, "`harness compare --ram "));
    const size_t at = p.why.find("--moe-cache ");
    CHECK(at != std::string::npos);
    if (at != std::string::npos) {
        const std::string spec = p.why.substr(at + 12, p.why.find(')', at) - at - 12);
        CHECK(has(spec, "host=file,ram=") && parses(spec));
    }
    p = llama_expert_auto_decide(r, file - 10*MiB, "cg", 0, 4, "");
    CHECK(!p.err.empty() && has(p.err, "--no-repack"));
    // a repack: the held memory has the repacked copy, so the fixed estimate is used (not held), as without it
    r.held = 6*MiB;
    p = llama_expert_auto_decide(r, file + 10*MiB, "cg", 0, 4, "");
    CHECK(p.off && has(p.why, "near the fit") && !has(p.why, "this process holds"));
    // unmapped (--no-mmap): the weights are in the held memory and counted there once: the file and 6 MiB held with
    // 0.58 MiB of compute buffers and logits (in bytes, unrounded: 348,160 and 262,144) fit in 10 MiB above the file;
    // the file and 9.7 MiB held do not (stock runs it, near the fit: the file tier needs mmap)
    llama_expert_auto_model u = m;
    u.mapped = false;
    u.held = file + 6*MiB;
    p = llama_expert_auto_decide(u, file + 10*MiB, "cg", 0, 4, "");
    CHECK(p.off && has(p.why, "stock is as fast") && has(p.why, auto_test_mib(file + 6*MiB + 610304) + " MiB with the "));
    u.held = file + 9*MiB + 7*MiB/10;
    p = llama_expert_auto_decide(u, file + 10*MiB, "cg", 0, 4, "");
    CHECK(p.off && p.err.empty() && has(p.why, "near the fit") && has(p.why, "mmap"));
    // no memory facts: nothing is near anything (the file tier is never chosen without a limit)
    p = llama_expert_auto_decide(m, UINT64_MAX, "none", 0, 4, "");
    CHECK(p.off && !has(p.why, "near the fit"));
}

// keys after auto: slots= replaces the plan's budget, mode= runs an off plan's keys, and the plan line names what
// the user replaced (issue 35, item 4)
// the file tier's runtime term: with the held memory known (a mapped model), what the process holds less its context
// and LLAMA_EXPERT_RUNTIME_GROWTH, in place of LLAMA_EXPERT_RUNTIME_BASELINE; the plan carries it for the engine
// near the fit, measured (issue 35): the mapped weights fit beside what the process holds and the estimate with a
// whole ubatch's compute buffers and a whole batch's logits does not. The plan is the file tier's, marked unsure with
// the ballast of a decode for the caller's measurement; the answer decides: all resident, stock (off, saying it was
// measured); some evicted, the file tier, saying how much stayed. Below the band, or with the held memory unknown,
// nothing is measured
static void test_measured_near_the_fit() {
    llama_expert_auto_model m;
    m.n_expert = 512; m.k = 10; m.n_vocab = 8192; m.n_embd = 256; m.n_ff_exp = 32; m.n_ctx = 512;
    m.n_ubatch = 8; m.n_batch = 8;  // 348,160 bytes of compute buffers and 262,144 of logits, unrounded
    m.per_slot = 6*3*32*256 + 6*3*32*34; m.experts = m.per_slot*512; m.n_banks = 18; m.max_slice = 8704;
    m.weights = 7*MiB; m.context = 2*MiB; m.held = 6*MiB;
    const uint64_t file = m.weights + m.experts;
    const uint64_t usable = file + 6*MiB + 256*1024;  // above the file and the held memory, below the estimate
    llama_expert_auto_plan p = llama_expert_auto_decide(m, usable, "cg", 0, 4, "");
    CHECK(!p.off && p.unsure && has(p.why, "runs from the file tier") && !has(p.why, "measured"));
    // a decode's ballast: a one-token ubatch (4 x (8192 + 512) x 1.25), one row of logits and the runtime's growth
    CHECK(p.ballast == 34816/4*5 + 4*8192 + LLAMA_EXPERT_STOCK_DECODE_GROWTH);
    m.n_seq = 4;  // a row of logits per sequence
    CHECK(llama_expert_auto_decide(m, usable, "cg", 0, 4, "").ballast == p.ballast + 3*4*8192);
    m.n_seq = 1;
    llama_expert_auto_model yes = m;
    yes.stock_fits = 1; yes.stock_touched = file; yes.stock_resident = file;
    p = llama_expert_auto_decide(yes, usable, "cg", 0, 4, "");
    CHECK(p.off && p.err.empty() && !p.unsure && has(p.why, "measured, all") && has(p.why, "stock is as fast"));
    CHECK(has(p.why, "llama-perplexity"));
    llama_expert_auto_model no = m;
    no.stock_fits = 0; no.stock_touched = file; no.stock_resident = file - 3*MiB;
    p = llama_expert_auto_decide(no, usable, "cg", 0, 4, "");
    CHECK(!p.off && !p.unsure && p.ballast == 0 && has(p.why, "runs from the file tier"));
    CHECK(has(p.why, "; measured, 85.6 of its 88.6 MiB") && has(p.why, "stayed resident when touched once, so it"));
    // below the band (the file and the held memory do not fit): the file tier, nothing to measure
    p = llama_expert_auto_decide(m, file + 5*MiB, "cg", 0, 4, "");
    CHECK(!p.off && !p.unsure);
    // a measurement below the band changes nothing: the estimate is sure there
    no.stock_fits = 1;
    p = llama_expert_auto_decide(no, file + 5*MiB, "cg", 0, 4, "");
    CHECK(!p.off && !has(p.why, "measured"));
    // the held memory unknown (a unit test's facts, a repack): the fixed estimate, never unsure
    llama_expert_auto_model u = m;
    u.held = 0;
    CHECK(!llama_expert_auto_decide(u, usable, "cg", 0, 4, "").unsure);
    // above the estimate: off without measuring
    p = llama_expert_auto_decide(m, file + 7*MiB, "cg", 0, 4, "");
    CHECK(p.off && !p.unsure && !has(p.why, "measured"));
}

static void test_file_tier_runtime() {
    CHECK(llama_expert_runtime_baseline(0, 2*MiB) == LLAMA_EXPERT_RUNTIME_BASELINE);
    CHECK(llama_expert_runtime_baseline(6*MiB, 2*MiB) == 4*MiB + LLAMA_EXPERT_RUNTIME_GROWTH);
    CHECK(llama_expert_runtime_baseline(1*MiB, 2*MiB) == LLAMA_EXPERT_RUNTIME_GROWTH);
    const llama_expert_auto_model m = big_model();
    const llama_expert_auto_plan fixed = llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "");
    CHECK(!fixed.off && fixed.runtime == 0 && fixed.slots == 93);
    // 200 MiB held (the context's 384 MiB is not in it here: the difference is 0) -> 8 MiB in place of 48: the same
    // ram=, 40 MiB more for the banks (94 slots of 132 MiB); with 3 GiB held besides the context, fewer slots
    llama_expert_auto_model h = m;
    h.held = 200*MiB;
    llama_expert_auto_plan p = llama_expert_auto_decide(h, 16*GiB, "x", RESERVE, 4, "");
    CHECK(!p.off && p.runtime == LLAMA_EXPERT_RUNTIME_GROWTH && p.slots == 94);
    CHECK(p.spec() == "mode=engine,policy=quality,host=file,ram=14745M,runtime=8M" && fixed.spec() ==
          "mode=engine,policy=quality,host=file,ram=14745M");
    h.held = m.context + 3*GiB;
    p = llama_expert_auto_decide(h, 16*GiB, "x", RESERVE, 4, "");
    CHECK(!p.off && p.runtime == 3*GiB + LLAMA_EXPERT_RUNTIME_GROWTH && p.slots < fixed.slots);
    CHECK(p.slots == (int32_t) ((14745*MiB - (1536*MiB + 384*MiB + 256*MiB + 5*(MiB + 8192) + p.runtime + 132*MiB +
        144*512)) / (132*MiB)));
    // a small model (studymoe's facts, 92 MiB usable): 6.5 MiB held -> 374 slots where the constant gave 145
    llama_expert_auto_model s;
    s.n_expert = 512; s.k = 10; s.per_slot = 156672; s.experts = s.per_slot*512; s.n_banks = 18; s.max_slice = 8704;
    s.weights = 6643712; s.context = 786432; s.mapped = true;
    const uint64_t usable = 92*MiB;
    p = llama_expert_auto_decide(s, usable, "cg", 5*MiB, 4, "");
    CHECK(!p.off && p.runtime == 0 && !has(p.spec(), "runtime="));
    const int32_t n_fixed = p.slots;
    CHECK(n_fixed == 145);
    s.held = 6*MiB + MiB/2;
    p = llama_expert_auto_decide(s, usable, "cg", 5*MiB, 4, "");
    // 6.5 MiB held less the context's 0.75 MiB, plus 8: 13.75 MiB, written (and counted) as runtime=14M
    CHECK(!p.off && p.runtime == 14*MiB && has(p.spec(), ",ram=82M,runtime=14M") && parses(p.spec()));
    CHECK(p.slots - n_fixed == (int32_t) ((48*MiB - p.runtime) / 156672) || p.slots - n_fixed ==
          (int32_t) ((48*MiB - p.runtime) / 156672) + 1);
    CHECK(p.slots == 372);
    // unmapped: the weights read in are in the held memory: the constant (and the file tier refused anyway)
    s.mapped = false;
    p = llama_expert_auto_decide(s, usable, "cg", 5*MiB, 4, "");
    CHECK(p.runtime == 0);
}

static void test_user_keys() {
    const llama_expert_auto_model m = big_model();
    llama_expert_auto_plan p = llama_expert_auto_decide(m, 16*GiB, "x", RESERVE, 4, "");
    CHECK(llama_expert_auto_spec(p, "slots=40") == "mode=engine,policy=quality,host=file,slots=40");
    CHECK(parses(llama_expert_auto_spec(p, "slots=40")));
    CHECK(llama_expert_auto_overridden(p, "slots=40") == "ram=14745M");
    CHECK(llama_expert_auto_overridden(p, "policy=speed,stats=s") == "policy=quality");
    CHECK(llama_expert_auto_overridden(p, "stats=s").empty());
    // an off plan with the user's mode=: their keys as given, one spec (no "given twice")
    p = llama_expert_auto_decide(m, 64*GiB, "x", RESERVE, 4, "");
    CHECK(p.off);
    CHECK(llama_expert_auto_spec(p, "mode=engine,slots=64") == "mode=engine,slots=64");
    CHECK(parses(llama_expert_auto_spec(p, "mode=engine,slots=64")));
    CHECK(llama_expert_auto_spec(p, "stats=s") == "mode=off,stats=s");
    // slots= with a budget by hand: refused, naming both
    llama_expert_cache_config cfg;
    std::string err;
    CHECK(!llama_expert_cache_config_parse("mode=engine,host=file,ram=1G,slots=40", cfg, err) && has(err, "slots=") &&
          has(err, "ram="));
}

int main() {
    test_compute_estimate();
    test_near_the_fit();
    test_measured_near_the_fit();
    test_file_tier_runtime();
    test_user_keys();
    test_remote_layers();
    test_cpu_plans();
    test_tuned_policy();
    test_gpu_plans();
    test_spec_composition();
    if (n_fail) {
        std::fprintf(stderr, "%d checks failed\n", n_fail);
        return 1;
    }
    std::printf("all expert auto tests passed\n");
    return 0;
}
