#include "nll-dump.h"

#include "log.h"

#include <cstdint>
#include <fstream>

bool nll_dump_write(const std::string & path, const std::vector<llama_token> & tokens,
        const std::vector<double> & nll_history, int n_ctx, int first, int n_chunk) {
    std::ofstream out(path, std::ios::binary);
    if (!out) {
        LOG_ERR("%s: failed to open %s for writing\n", __func__, path.c_str());
        return false;
    }
    const uint32_t head[4] = { 1, (uint32_t) n_ctx, (uint32_t) first, (uint32_t) n_chunk };
    const uint64_t count   = (uint64_t) n_chunk * (n_ctx - first - 1);
    out.write("LLNLLDMP", 8);
    out.write(reinterpret_cast<const char *>(head), sizeof(head));
    out.write(reinterpret_cast<const char *>(&count), sizeof(count));
    for (int c = 0; c < n_chunk; ++c) {
        out.write(reinterpret_cast<const char *>(tokens.data() + (size_t) c*n_ctx + first + 1), sizeof(llama_token)*(n_ctx - first - 1));
    }
    for (int c = 0; c < n_chunk; ++c) {
        out.write(reinterpret_cast<const char *>(nll_history.data() + (size_t) c*n_ctx + first), sizeof(double)*(n_ctx - first - 1));
    }
    if (!out) {
        LOG_ERR("%s: failed to write %s\n", __func__, path.c_str());
        return false;
    }
    LOG_INF("%s: wrote %llu token NLLs to %s\n", __func__, (unsigned long long) count, path.c_str());
    return true;
}
