#include "llama-expert-replay.h"

#include "llama-expert-paths.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>

// the router trace's layout: docs/expert-cache.md "Router trace" (written by llama-expert-trace.cpp)
static constexpr size_t REPLAY_HEADER_SIZE = 64;

static bool replay_fail(std::string & err, const std::string & msg) {
    err = msg;
    return false;
}

bool llama_expert_replay::load(const std::string & path_, int32_t n_expert_, int32_t k_, const std::vector<bool> & moe,
        std::string & err) {
    path = path_;
    n_expert = n_expert_;
    k = k_;
    const std::string who = std::string(LLAMA_EXPERT_REPLAY_ENV) + "=" + path + ": ";
    if (!llama_expert_path_check(LLAMA_EXPERT_REPLAY_ENV "=", path, err)) {
        return false;
    }
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        return replay_fail(err, who + "cannot open the router trace (" + std::strerror(errno) + ")");
    }
    std::vector<uint8_t> data;
    {
        uint8_t buf[1 << 16];
        size_t n;
        while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
            data.insert(data.end(), buf, buf + n);
        }
        const bool bad = std::ferror(f) != 0;
        std::fclose(f);
        if (bad) {
            return replay_fail(err, who + "read error");
        }
    }
    if (data.size() < REPLAY_HEADER_SIZE || std::memcmp(data.data(), "MOETRACE", 8) != 0) {
        return replay_fail(err, who + "not a router trace of the expert cache (no MOETRACE header)");
    }
    uint32_t h[7];
    std::memcpy(h, data.data() + 8, sizeof(h));
    const uint32_t version = h[0], hsize = h[1], t_expert = h[3], t_k = h[4], top_m = h[5], rsize = h[6];
    if ((version != 1 && version != 2) || hsize != REPLAY_HEADER_SIZE) {
        return replay_fail(err, who + "trace version " + std::to_string(version) + " is not one this build reads (1, 2)");
    }
    if ((int32_t) t_expert != n_expert || (int32_t) t_k != k) {
        return replay_fail(err, who + "the trace has " + std::to_string(t_expert) + " experts per layer and k = " +
            std::to_string(t_k) + "; this model has " + std::to_string(n_expert) + " and k = " + std::to_string(k) +
            ": replay needs a trace of the same routing shape");
    }
    const uint32_t want = 8 + 12*t_k + ((t_k + 3) & ~3u) + 8*top_m + (version >= 2 ? 4*t_k : 0);
    if (rsize != want || (data.size() - REPLAY_HEADER_SIZE) % rsize != 0) {
        return replay_fail(err, who + "damaged or truncated trace (record size " + std::to_string(rsize) + ", " +
            std::to_string(data.size() - REPLAY_HEADER_SIZE) + " bytes of records)");
    }
    const size_t n_rec = (data.size() - REPLAY_HEADER_SIZE) / rsize;

    std::map<uint32_t, size_t> entry_of; // trace layer -> entry
    for (size_t i = 0; i < n_rec; ++i) {
        const uint8_t * rec = data.data() + REPLAY_HEADER_SIZE + i*rsize;
        uint32_t layer;
        std::memcpy(&layer, rec, 4);
        auto it = entry_of.find(layer);
        if (it == entry_of.end()) {
            it = entry_of.emplace(layer, ids.size()).first;
            ids.emplace_back();
            weights.emplace_back();
            trace_layer.push_back(layer);
        }
        auto & vi = ids[it->second];
        auto & vw = weights[it->second];
        const size_t at = vi.size();
        vi.resize(at + k);
        vw.resize(at + k);
        std::memcpy(vi.data() + at, rec + 8, 4*(size_t) k);
        std::memcpy(vw.data() + at, rec + 8 + 4*(size_t) k, 4*(size_t) k);
        for (int32_t r = 0; r < k; ++r) {
            if (vi[at + r] < 0 || vi[at + r] >= n_expert) {
                return replay_fail(err, who + "record " + std::to_string(i) + " selects expert " +
                    std::to_string(vi[at + r]) + " (n_expert " + std::to_string(n_expert) + ")");
            }
        }
    }
    if (ids.empty()) {
        return replay_fail(err, who + "the trace has no records");
    }
    // the trace's layers in layer order (records interleave layers by ubatch)
    std::vector<size_t> order(ids.size());
    for (size_t i = 0; i < order.size(); ++i) {
        order[i] = i;
    }
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return trace_layer[a] < trace_layer[b]; });

    const int32_t L = (int32_t) order.size();
    int32_t n_moe = 0;
    for (bool m : moe) {
        n_moe += m ? 1 : 0;
    }
    const int32_t groups = (n_moe + L - 1) / L; // model layers per trace layer, at most
    layer_src.assign(moe.size(), -1);
    cursor.assign(moe.size(), 0);
    int32_t j = 0;
    for (size_t il = 0; il < moe.size(); ++il) {
        if (!moe[il]) {
            continue;
        }
        const size_t e = order[j % L];
        const uint64_t n = ids[e].size() / k;
        layer_src[il] = (int32_t) e;
        cursor[il] = (uint64_t) (j / L) * n / (uint64_t) std::max(groups, 1);
        ++j;
    }
    return true;
}

void llama_expert_replay::next(int32_t il, int32_t * out_ids, float * out_w) {
    const int32_t e = layer_src[il];
    const uint64_t n = ids[e].size() / k;
    const uint64_t c = cursor[il] % n;
    std::memcpy(out_ids, ids[e].data() + c*k, 4*(size_t) k);
    std::memcpy(out_w, weights[e].data() + c*k, 4*(size_t) k);
    cursor[il] = c + 1;
}

std::string llama_expert_replay::describe() const {
    size_t n_min = SIZE_MAX;
    for (const auto & v : ids) {
        n_min = std::min(n_min, v.size() / k);
    }
    int32_t n_moe = 0;
    for (int32_t s : layer_src) {
        n_moe += s >= 0 ? 1 : 0;
    }
    return "routing replayed from the router trace " + path + " (" + std::to_string(ids.size()) + " MoE layers, at least " +
        std::to_string(n_min) + " token-layers each) onto the model's " + std::to_string(n_moe) +
        " MoE layers; TEST ONLY: outputs are not the model's (speed and hit rates only)";
}
