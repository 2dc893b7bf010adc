// llama-moe-sim: replay a router trace of the moe-subst expert cache under any cache spec.
//
// The engine (LLAMA_MOE_CACHE=...,trace=PATH) records, per token and MoE layer, the selected experts, their
// normalised gate weights and the router's top scores. This tool feeds those records, in the order the
// engine decided them, to the engine's own expert cache (llama_expert_cache_impl: the same configuration parser,
// slot checks, initial residency and profile handling, the same residency policy and the same statistics
// writer), configured by another spec and built from the trace's shape alone (no model, stand-in or real), so that a
// policy sweep needs no model run and simulator and engine cannot disagree. Only the gating arithmetic of the route step is skipped: the trace holds its result.
//
// The substitute for a miss is the resident expert with the highest router score; the trace keeps the top_m
// scores of each token (trace_top in the spec, default 16). Experts outside them are taken as scoring below
// all of them (ties: lowest id), so the replay equals the engine exactly when the trace was recorded with
// trace_top = n_expert; otherwise only the choice among low-scoring substitutes can differ. (The engine ranks
// by logit, the trace holds probabilities: the same order, unless two probabilities round to the same float.)

#include "llama-expert-cache-impl.h"
#include "llama-expert-fingerprint.h"
#include "llama-expert-policy.h"
#include "llama-expert-paths.h"

#include "llama.h"
#include "ggml.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define MOE_SIM_TRACE_MAGIC       "MOETRACE"
#define MOE_SIM_TRACE_HEADER_SIZE 64

struct moe_sim_trace {
    uint32_t version     = 0;
    uint32_t n_layer     = 0;
    uint32_t n_expert    = 0;
    uint32_t k           = 0;
    uint32_t top_m       = 0;
    uint32_t record_size = 0;
    uint32_t n_slots     = 0; // of the recorded run
    uint64_t fingerprint = 0; // of the model it was recorded on (llama-expert-fingerprint.h); 0: none (older traces)

    // the records, 4-byte aligned (every field is 4 bytes wide, the action bytes are padded to 4)
    std::vector<uint32_t> data;
    size_t                n_records = 0;

    // per layer: records in the trace (0: not a MoE layer, or no token was decided), and the first of them;
    // after loading, the records are grouped by layer (in the order decided within each layer)
    std::vector<uint64_t> layer_records;
    std::vector<size_t>   layer_first;

    const uint8_t * record(size_t i) const {
        return (const uint8_t *) data.data() + i*record_size;
    }
    // field offsets within a record
    size_t off_ids()       const { return 8; }
    size_t off_weights()   const { return 8 + 4*(size_t) k; }
    size_t off_used()      const { return 8 + 8*(size_t) k; }
    size_t off_actions()   const { return 8 + 12*(size_t) k; }
    size_t off_top_ids()   const { return 8 + 12*(size_t) k + ((k + 3) & ~3u); }
    size_t off_top_score() const { return off_top_ids() + 4*(size_t) top_m; }
    // version 2: the previous MoE layer's prediction for the record (prefetch), k ids, -1 where none
    bool   has_pred()      const { return version >= 2; }
    size_t off_pred()      const { return off_top_score() + 4*(size_t) top_m; }
};

static bool moe_sim_fail(std::string & err, const std::string & msg) {
    err = msg;
    return false;
}

// read and check a trace; every record is validated here so that the replay loop needs no checks
static bool moe_sim_trace_read(const std::string & path, moe_sim_trace & tr, std::string & err) {
    if (!llama_expert_path_check("--trace ", path, err)) { return false; } // a FIFO would block fopen()
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        return moe_sim_fail(err, "cannot open the trace '" + path + "'");
    }
    uint8_t hdr[MOE_SIM_TRACE_HEADER_SIZE];
    const size_t n_hdr = std::fread(hdr, 1, sizeof(hdr), f);
    if (n_hdr < 8 || std::memcmp(hdr, MOE_SIM_TRACE_MAGIC, 8) != 0) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "' is not a router trace of the expert cache (no MOETRACE header)");
    }
    if (n_hdr < sizeof(hdr)) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': truncated header");
    }
    uint32_t h[14];
    std::memcpy(h, hdr + 8, sizeof(h));
    const uint32_t hsize = h[1];
    tr.version     = h[0];
    tr.n_layer     = h[2];
    tr.n_expert    = h[3];
    tr.k           = h[4];
    tr.top_m       = h[5];
    tr.record_size = h[6];
    tr.n_slots     = h[7];
    tr.fingerprint = (uint64_t) h[8] | ((uint64_t) h[9] << 32);
    if (tr.version < 1 || tr.version > LLAMA_EXPERT_TRACE_VERSION || hsize != MOE_SIM_TRACE_HEADER_SIZE) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': trace version " + std::to_string(tr.version) + " (header " +
            std::to_string(hsize) + " bytes); this tool reads versions 1 to " + std::to_string(LLAMA_EXPERT_TRACE_VERSION));
    }
    if (tr.n_layer == 0 || tr.n_layer > LLAMA_MAX_LAYERS || tr.n_expert == 0 || tr.n_expert > LLAMA_MAX_EXPERTS ||
            tr.k == 0 || tr.k > tr.n_expert || tr.top_m > tr.n_expert) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': implausible header (n_layer " + std::to_string(tr.n_layer) +
            ", n_expert " + std::to_string(tr.n_expert) + ", k " + std::to_string(tr.k) + ", top_m " +
            std::to_string(tr.top_m) + ")");
    }
    const uint32_t want_rsize = 8 + 12*tr.k + ((tr.k + 3) & ~3u) + 8*tr.top_m + (tr.version >= 2 ? 4*tr.k : 0);
    if (tr.record_size != want_rsize) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': record size " + std::to_string(tr.record_size) +
            " does not match version " + std::to_string(tr.version) + ", k = " + std::to_string(tr.k) + ", top_m = " + std::to_string(tr.top_m) +
            " (" + std::to_string(want_rsize) + ")");
    }

    std::fseek(f, 0, SEEK_END);
    const long end = std::ftell(f);
    if (end < 0) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': cannot determine its size");
    }
    const size_t body = (size_t) end - MOE_SIM_TRACE_HEADER_SIZE;
    if (body % tr.record_size != 0) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': truncated trace (" + std::to_string(body) +
            " bytes of records, not a multiple of " + std::to_string(tr.record_size) + ")");
    }
    tr.n_records = body / tr.record_size;
    tr.data.resize(body / 4);
    std::fseek(f, MOE_SIM_TRACE_HEADER_SIZE, SEEK_SET);
    if (body > 0 && std::fread(tr.data.data(), 1, body, f) != body) {
        std::fclose(f);
        return moe_sim_fail(err, "'" + path + "': read error");
    }
    std::fclose(f);

    // validate: layer ids, tokens in order per layer, expert ids
    tr.layer_records.assign(tr.n_layer, 0);
    const int32_t E = (int32_t) tr.n_expert;
    std::vector<int32_t> ids(tr.k), top(tr.top_m);
    std::vector<float> w(tr.k), w_top(tr.top_m);
    for (size_t i = 0; i < tr.n_records; ++i) {
        const uint8_t * rec = tr.record(i);
        uint32_t head[2];
        std::memcpy(head, rec, sizeof(head));
        const std::string where = "'" + path + "': record " + std::to_string(i);
        if (head[0] >= tr.n_layer) {
            return moe_sim_fail(err, where + " has layer " + std::to_string(head[0]) + " >= n_layer " + std::to_string(tr.n_layer));
        }
        if (head[1] != tr.layer_records[head[0]]) {
            return moe_sim_fail(err, where + ": layer " + std::to_string(head[0]) + " token " + std::to_string(head[1]) +
                " is out of order (expected token " + std::to_string(tr.layer_records[head[0]]) + ")");
        }
        tr.layer_records[head[0]]++;
        std::memcpy(ids.data(), rec + tr.off_ids(), 4*tr.k);
        for (int32_t e : ids) {
            if (e < 0 || e >= E) {
                return moe_sim_fail(err, where + " selects expert " + std::to_string(e) + " (n_expert " + std::to_string(E) + ")");
            }
        }
        for (uint32_t a = 0; a < tr.k; ++a) {
            for (uint32_t b = a + 1; b < tr.k; ++b) {
                if (ids[a] == ids[b]) {
                    return moe_sim_fail(err, where + " selects expert " + std::to_string(ids[a]) + " twice");
                }
            }
        }
        if (tr.has_pred()) {
            std::memcpy(ids.data(), rec + tr.off_pred(), 4*tr.k);
            for (int32_t e : ids) {
                if (e < -1 || e >= E) {
                    return moe_sim_fail(err, where + " predicts expert " + std::to_string(e) + " (n_expert " + std::to_string(E) +
                        "; -1: no prediction)");
                }
            }
        }
        std::memcpy(top.data(), rec + tr.off_top_ids(), 4*tr.top_m);
        for (int32_t e : top) {
            if (e < 0 || e >= E) {
                return moe_sim_fail(err, where + " has top expert " + std::to_string(e) + " (n_expert " + std::to_string(E) + ")");
            }
        }
        // gate weights and router scores decide the replay: a damaged value would silently change every decision
        std::memcpy(w.data(), rec + tr.off_weights(), 4*tr.k);
        for (float x : w) {
            if (!std::isfinite(x) || x < 0.0f) {
                return moe_sim_fail(err, where + " has gate weight " + std::to_string(x) + " (finite and >= 0 expected)");
            }
        }
        std::memcpy(w_top.data(), rec + tr.off_top_score(), 4*tr.top_m);
        for (float x : w_top) {
            if (!std::isfinite(x)) {
                return moe_sim_fail(err, where + " has router score " + std::to_string(x) + " (finite expected)");
            }
        }
    }

    // group the records by layer, keeping their order within a layer (the order the engine decided them):
    // a layer is replayed from contiguous memory
    tr.layer_first.assign(tr.n_layer, 0);
    for (uint32_t il = 1; il < tr.n_layer; ++il) {
        tr.layer_first[il] = tr.layer_first[il - 1] + tr.layer_records[il - 1];
    }
    std::vector<uint32_t> grouped(tr.data.size());
    std::vector<size_t>   next = tr.layer_first;
    const size_t words = tr.record_size / 4;
    for (size_t i = 0; i < tr.n_records; ++i) {
        uint32_t il;
        std::memcpy(&il, tr.record(i), 4);
        std::memcpy(grouped.data() + next[il]++ * words, tr.record(i), tr.record_size);
    }
    tr.data.swap(grouped);
    return true;
}

// The shape of the traced model, as the cache's policies need it: layers, experts, experts per token, and which
// layers have routed experts (those that have records in the trace). No model is loaded.
static llama_expert_model_shape moe_sim_shape(const moe_sim_trace & tr) {
    llama_expert_model_shape shape;
    shape.n_layer  = (int32_t) tr.n_layer;
    shape.n_expert = (int32_t) tr.n_expert;
    shape.n_used   = (int32_t) tr.k;
    shape.arch     = "the traced model";
    shape.moe.resize(tr.n_layer);
    for (uint32_t il = 0; il < tr.n_layer; ++il) {
        shape.moe[il] = tr.layer_records[il] > 0;
    }
    return shape;
}

struct moe_sim_verify {
    uint64_t actions_differ = 0; // token-layers whose actions differ from the recorded ones
    uint64_t used_differ    = 0; // token-layers with the same actions but another expert computed with
};

// Replay the records of one layer, in the order the engine decided them. Scores of experts outside the
// recorded top_m are -inf.
static void moe_sim_replay_layer(const moe_sim_trace & tr, uint32_t il, llama_expert_layer_policy & pol,
                                 moe_sim_verify * verify) {
    const uint32_t k = tr.k;
    std::vector<float>   scores(tr.n_expert, -INFINITY);
    std::vector<int32_t> out(k);
    std::vector<uint8_t> act(k);

    // the records are 4-byte aligned and never written after loading: their fields are read in place
    const size_t end = tr.layer_first[il] + tr.layer_records[il];
    for (size_t i = tr.layer_first[il]; i < end; ++i) {
        const uint8_t * rec   = tr.record(i);
        const int32_t * ids   = (const int32_t *) (rec + tr.off_ids());
        const float   * w     = (const float   *) (rec + tr.off_weights());
        const int32_t * top   = (const int32_t *) (rec + tr.off_top_ids());
        const float   * top_s = (const float   *) (rec + tr.off_top_score());

        for (uint32_t j = 0; j < tr.top_m; ++j) {
            scores[top[j]] = top_s[j];
        }
        if (pol.params().prefetch) {
            // the prediction the previous MoE layer made for this token-layer, admitted before the decision
            pol.prefetch_experts((const int32_t *) (rec + tr.off_pred()), (int32_t) k);
        }
        pol.decide(ids, w, (int32_t) k, scores.data(), out.data(), act.data());
        for (uint32_t j = 0; j < tr.top_m; ++j) {
            scores[top[j]] = -INFINITY;
        }

        if (verify) {
            if (std::memcmp(act.data(), rec + tr.off_actions(), k) != 0) {
                verify->actions_differ++;
            } else if (std::memcmp(out.data(), rec + tr.off_used(), 4*k) != 0) {
                verify->used_differ++;
            }
        }
    }
}

// One replay of the whole trace. Layers are independent (each has its own policy state), so they are
// shared out to n_threads threads.
static void moe_sim_replay(const moe_sim_trace & tr, llama_expert_cache_impl & cache, int n_threads, moe_sim_verify * verify) {
    std::vector<uint32_t> todo;
    for (uint32_t il = 0; il < tr.n_layer; ++il) {
        if (tr.layer_records[il] > 0) {
            todo.push_back(il);
        }
    }
    // longest first, so that the threads finish together
    std::stable_sort(todo.begin(), todo.end(), [&](uint32_t a, uint32_t b) {
        return tr.layer_records[a] > tr.layer_records[b];
    });
    std::atomic<size_t> next{0};
    std::vector<moe_sim_verify> ver(n_threads);
    auto work = [&](int ith) {
        for (size_t j = next++; j < todo.size(); j = next++) {
            const uint32_t il = todo[j];
            moe_sim_replay_layer(tr, il, cache.layers[il]->policy, verify ? &ver[ith] : nullptr);
        }
    };
    std::vector<std::thread> workers;
    for (int t = 1; t < n_threads; ++t) {
        workers.emplace_back(work, t);
    }
    work(0);
    for (auto & t : workers) {
        t.join();
    }
    if (verify) {
        for (const auto & v : ver) {
            verify->actions_differ += v.actions_differ;
            verify->used_differ    += v.used_differ;
        }
    }
}

static bool moe_sim_quiet = false;

static void moe_sim_log(ggml_log_level level, const char * text, void * /*user_data*/) {
    if (moe_sim_quiet && (level == GGML_LOG_LEVEL_INFO || level == GGML_LOG_LEVEL_DEBUG || level == GGML_LOG_LEVEL_CONT)) {
        return;
    }
    std::fputs(text, stderr);
}

static void moe_sim_usage(const char * argv0) {
    std::printf(
        "usage: %s --trace FILE [--spec SPEC] [options]\n"
        "\n"
        "Replays a router trace of the moe-subst expert cache (written by the patched engine with\n"
        "LLAMA_MOE_CACHE=...,trace=FILE) under another cache spec, with the engine's own policy code,\n"
        "and writes the engine's statistics JSON (schema moe-subst/expert-cache-stats).\n"
        "\n"
        "options:\n"
        "  -t, --trace FILE   the router trace (required)\n"
        "  -s, --spec SPEC    cache spec, as LLAMA_MOE_CACHE takes it, e.g. \"policy=quality,slots=25%%\"\n"
        "                     (default: \"policy=fetch-all\"); profile=, profile_out= and stats= apply,\n"
        "                     trace= is ignored (the trace is the input); prefetch=on replays the trace's\n"
        "                     predictions (version 2: every trace records them)\n"
        "  -m, --model FILE   the model the trace should have been recorded on: a trace of another model (its\n"
        "                     fingerprint differs) is refused; one without a fingerprint (older traces) is\n"
        "                     replayed with a warning\n"
        "  -o, --stats FILE   write the statistics JSON to FILE (default: the spec's stats=, else stdout)\n"
        "  -j, --threads N    threads; MoE layers are replayed in parallel (default: the CPUs, at most the\n"
        "                     MoE layers)\n"
        "  --repeat N         replay N times (for benchmarks); the statistics are those of the last replay\n"
        "  --verify           count token-layers whose decisions differ from the recorded ones (meaningful\n"
        "                     when SPEC is the recorded run's spec); exit 3 when any action differs\n"
        "  --info             print the trace header and per-layer record counts, and exit\n"
        "  -q, --quiet        no log lines (errors and the replay summary still go to stderr)\n"
        "  -h, --help\n"
        "\n"
        "Substitutes are chosen by router score among the trace's top_m scores per token (trace_top);\n"
        "the replay equals the engine exactly when the trace was recorded with trace_top = n_expert.\n",
        argv0);
}

// the command line
struct moe_sim_args {
    std::string trace_path;
    std::string spec = "policy=fetch-all";
    std::string stats_path;
    std::string model_path;
    int         repeat = 1;
    int         n_threads = 0;
    bool        verify = false;
    bool        info   = false;
};

// the command line parsed: 0 to go on, else the exit status (--help: 0 with `done`)
static int moe_sim_parse_args(int argc, char ** argv, moe_sim_args & args, bool & done) {
    done = false;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&](const char * what) -> std::string {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "llama-moe-sim: error: %s needs %s\n", a.c_str(), what);
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "-t" || a == "--trace") {
            args.trace_path = next("a file");
        } else if (a == "-s" || a == "--spec") {
            args.spec = next("a cache spec");
        } else if (a == "-m" || a == "--model") {
            args.model_path = next("a file");
        } else if (a == "-o" || a == "--stats") {
            args.stats_path = next("a file");
        } else if (a == "--repeat") {
            const std::string v = next("a count");
            char * end = nullptr;
            const long n = std::strtol(v.c_str(), &end, 10);
            if (end == v.c_str() || *end != '\0' || n < 1 || n > 1000000) {
                std::fprintf(stderr, "llama-moe-sim: error: --repeat needs a count >= 1, not '%s'\n", v.c_str());
                return 2;
            }
            args.repeat = (int) n;
        } else if (a == "-j" || a == "--threads") {
            const std::string v = next("a count");
            char * end = nullptr;
            const long n = std::strtol(v.c_str(), &end, 10);
            if (end == v.c_str() || *end != '\0' || n < 1 || n > 1024) {
                std::fprintf(stderr, "llama-moe-sim: error: --threads needs a count >= 1, not '%s'\n", v.c_str());
                return 2;
            }
            args.n_threads = (int) n;
        } else if (a == "--verify") {
            args.verify = true;
        } else if (a == "--info") {
            args.info = true;
        } else if (a == "-q" || a == "--quiet") {
            moe_sim_quiet = true;
        } else if (a == "-h" || a == "--help") {
            moe_sim_usage(argv[0]);
            done = true;
            return 0;
        } else {
            std::fprintf(stderr, "llama-moe-sim: error: unknown argument '%s' (see --help)\n", a.c_str());
            return 2;
        }
    }
    return 0;
}

// --model: a trace of another model would replay another model's routing: refused before anything else
static bool moe_sim_check_model(const moe_sim_trace & tr, const std::string & trace_path, const std::string & model_path) {
    std::string err;
    uint64_t fp = 0;
    if (!llama_expert_fingerprint_of_file(model_path, fp, err)) {
        std::fprintf(stderr, "llama-moe-sim: error: --model: %s\n", err.c_str());
        return false;
    }
    if (tr.fingerprint == 0) {
        std::fprintf(stderr, "llama-moe-sim: warning: the trace '%s' carries no fingerprint of the model it was "
            "recorded on (an older trace): that it was recorded on '%s' is not checked\n", trace_path.c_str(),
            model_path.c_str());
    } else if (tr.fingerprint != fp) {
        std::fprintf(stderr, "llama-moe-sim: error: the trace '%s' was recorded on another model than '%s' (model "
            "fingerprint %016llx in the trace, %016llx of this model): pass the model the trace was recorded with\n",
            trace_path.c_str(), model_path.c_str(), (unsigned long long) tr.fingerprint, (unsigned long long) fp);
        return false;
    }
    return true;
}

// --info: the trace's header and its records per layer
static void moe_sim_print_info(const moe_sim_trace & tr, const std::string & trace_path, int32_t n_moe) {
    std::printf("trace %s: version %u, n_layer %u, n_expert %u, k %u, top_m %u, record %u bytes, "
                "recorded with %u slots, %zu records, %d MoE layers, model fingerprint %016llx\n",
                trace_path.c_str(), tr.version, tr.n_layer, tr.n_expert, tr.k, tr.top_m, tr.record_size,
                tr.n_slots, tr.n_records, n_moe, (unsigned long long) tr.fingerprint);
    for (uint32_t il = 0; il < tr.n_layer; ++il) {
        if (tr.layer_records[il] > 0) {
            std::printf("layer %u: %llu tokens\n", il, (unsigned long long) tr.layer_records[il]);
        }
    }
}

// the spec as a replay runs it: parsed, checked against the trace, emulate, the statistics' path taken out (written
// at the end, where a failure sets the exit code); 0, or the exit status
static int moe_sim_config(const std::string & spec, const moe_sim_trace & tr, const std::string & trace_path,
        std::string & stats_path, llama_expert_cache_config & cfg) {
    std::string err;
    if (!llama_expert_cache_config_parse(spec, cfg, err)) {
        std::fprintf(stderr, "llama-moe-sim: error: --spec '%s': %s\n", spec.c_str(), err.c_str());
        return 2;
    }
    if (cfg.mode == LLAMA_EXPERT_CACHE_MODE_OFF) {
        std::fprintf(stderr, "llama-moe-sim: error: --spec '%s' turns the cache off: nothing to replay\n", spec.c_str());
        return 2;
    }
    if (cfg.prefetch && !tr.has_pred()) {
        std::fprintf(stderr, "llama-moe-sim: error: --spec '%s': prefetch=on replays the predictions of a version-2 trace, "
            "and '%s' is version %u: record it again with this build\n", spec.c_str(), trace_path.c_str(), tr.version);
        return 2;
    }
    // a replay decides without moving memory, whatever mode the spec names: emulate
    cfg.mode = LLAMA_EXPERT_CACHE_MODE_EMULATE;
    if (!cfg.trace.empty()) {
        if (!moe_sim_quiet) {
            std::fprintf(stderr, "llama-moe-sim: note: ignoring trace=%s in the spec (the input is --trace)\n", cfg.trace.c_str());
        }
        cfg.trace.clear();
    }
    if (!stats_path.empty()) {
        if (!llama_expert_path_check("--stats ", stats_path, err)) { // a FIFO would block at the end of the replay
            std::fprintf(stderr, "llama-moe-sim: error: %s\n", err.c_str());
            return 2;
        }
        cfg.stats = stats_path;
    } else if (cfg.stats.empty()) {
        cfg.stats = "/dev/stdout";
    }
    stats_path = cfg.stats;
    cfg.stats.clear(); // written below, where a failure sets the exit code
    return 0;
}

int main(int argc, char ** argv) {
    moe_sim_args args;
    bool done = false;
    if (const int rc = moe_sim_parse_args(argc, argv, args, done); rc != 0 || done) {
        return rc;
    }
    const std::string & trace_path = args.trace_path;
    std::string &       stats_path = args.stats_path;
    const int           repeat     = args.repeat;
    int                 n_threads  = args.n_threads;
    const bool          verify     = args.verify;
    if (trace_path.empty()) {
        moe_sim_usage(argv[0]);
        return 2;
    }
    llama_log_set(moe_sim_log, nullptr);

    moe_sim_trace tr;
    std::string err;
    if (!moe_sim_trace_read(trace_path, tr, err)) {
        std::fprintf(stderr, "llama-moe-sim: error: %s\n", err.c_str());
        return 1;
    }
    int32_t n_moe = 0;
    for (uint64_t n : tr.layer_records) {
        n_moe += n > 0;
    }

    if (!args.model_path.empty() && !moe_sim_check_model(tr, trace_path, args.model_path)) {
        return 1;
    }
    if (args.info) {
        moe_sim_print_info(tr, trace_path, n_moe);
        return 0;
    }
    if (n_moe == 0) {
        std::fprintf(stderr, "llama-moe-sim: error: '%s' holds no records (no token was decided)\n", trace_path.c_str());
        return 1;
    }

    if (n_threads == 0) {
        n_threads = (int) std::max(1u, std::thread::hardware_concurrency());
    }
    n_threads = std::min(n_threads, n_moe);

    llama_expert_cache_config cfg;
    if (const int rc = moe_sim_config(args.spec, tr, trace_path, stats_path, cfg); rc != 0) {
        return rc;
    }

    std::unique_ptr<llama_expert_cache_impl> cache;
    try {
        cache = std::make_unique<llama_expert_cache_impl>(cfg, moe_sim_shape(tr));
    } catch (const std::exception & e) {
        // the engine's messages are prefixed with LLAMA_MOE_CACHE='spec'
        std::fprintf(stderr, "llama-moe-sim: error: %s\n", e.what());
        return 2;
    }

    moe_sim_verify ver;
    double t_total = 0.0;
    double t_last  = 0.0;
    const std::clock_t cpu0 = std::clock();
    for (int r = 0; r < repeat; ++r) {
        if (r > 0) {
            cache->reset();
        }
        ver = moe_sim_verify();
        const auto t0 = std::chrono::steady_clock::now();
        moe_sim_replay(tr, *cache, n_threads, verify ? &ver : nullptr);
        t_last = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        t_total += t_last;
    }

    // host time of the decision procedure: the replay time, shared by the layers by their records
    for (uint32_t il = 0; il < tr.n_layer; ++il) {
        auto & L = *cache->layers[il];
        L.route_tokens = tr.layer_records[il];
        L.route_ns     = (uint64_t) std::llround(t_last * 1e9 * (double) tr.layer_records[il] / (double) tr.n_records);
    }

    const double cpu_s     = (double) (std::clock() - cpu0) / CLOCKS_PER_SEC;
    const double decisions = (double) tr.n_records * repeat;
    std::fprintf(stderr, "llama-moe-sim: replayed %zu token-layer decisions (%d MoE layers) x %d in %.6f s: "
                 "%.3f million decisions/s (%d threads, %.6f s CPU)\n", tr.n_records, n_moe, repeat, t_total,
                 t_total > 0 ? decisions / t_total * 1e-6 : 0.0, n_threads, cpu_s);
    int rc = 0;
    if (verify) {
        std::fprintf(stderr, "llama-moe-sim: verify: %llu of %zu token-layers differ in their actions, "
                     "%llu more in the expert computed with\n", (unsigned long long) ver.actions_differ, tr.n_records,
                     (unsigned long long) ver.used_differ);
        // a different substitute alone can come from two router probabilities that round to the same float
        // (the engine ranks by logit): reported, not a failure
        if (ver.actions_differ > 0) {
            rc = 3;
        }
    }
    std::fflush(stdout);
    if (!cache->write_stats(stats_path)) {
        std::fprintf(stderr, "llama-moe-sim: error: could not write the statistics to %s\n", stats_path.c_str());
        rc = 1;
    }
    cache.reset(); // prints the summary line, writes profile_out
    return rc;
}
