#include "llama-expert-profile.h"

#include <cstdio>
#include <fstream>
#include <sstream>

bool llama_expert_profile_read(const std::string & path, std::vector<std::vector<uint64_t>> & counts, std::string & err) {
    std::ifstream f(path);
    if (!f) {
        err = "cannot open profile '" + path + "'";
        return false;
    }
    std::string line;
    if (!std::getline(f, line) || line.rfind("moe-expert-profile 1", 0) != 0) {
        err = "profile '" + path + "' does not start with 'moe-expert-profile 1'";
        return false;
    }
    counts.clear();
    while (std::getline(f, line)) {
        if (line.empty() || line[0] == '#') {
            continue;
        }
        std::istringstream ss(line);
        std::string tag;
        int64_t il = -1, n = -1;
        if (!(ss >> tag >> il >> n) || tag != "layer" || il < 0 || il > 100000 || n <= 0 || n > 1000000) {
            err = "profile '" + path + "': bad line '" + line.substr(0, 60) + "'";
            return false;
        }
        if ((int64_t) counts.size() <= il) {
            counts.resize(il + 1);
        }
        auto & c = counts[il];
        c.resize(n);
        for (int64_t i = 0; i < n; ++i) {
            if (!(ss >> c[i])) {
                err = "profile '" + path + "': layer " + std::to_string(il) + " has fewer than " + std::to_string(n) + " counts";
                return false;
            }
        }
    }
    return true;
}

bool llama_expert_profile_write(const std::string & path, const std::vector<const llama_expert_layer_policy *> & layers,
                                const std::vector<int32_t> & layer_ids) {
    FILE * f = std::fopen(path.c_str(), "w");
    if (!f) {
        return false;
    }
    std::fprintf(f, "moe-expert-profile 1\n");
    for (size_t i = 0; i < layers.size(); ++i) {
        const auto * lp = layers[i];
        std::fprintf(f, "layer %d %d", layer_ids[i], lp->n_expert);
        for (uint64_t c : lp->sel_total) {
            std::fprintf(f, " %llu", (unsigned long long) c);
        }
        std::fprintf(f, "\n");
    }
    const bool ok = !std::ferror(f);
    return std::fclose(f) == 0 && ok;
}
