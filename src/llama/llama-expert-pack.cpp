#include "llama-expert-pack.h"

#include "llama-impl.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include <unistd.h>

// the format: harness/domain/pack.py (PACK_MAGIC, PACK_VERSION, the three structs)
static constexpr char     PACK_MAGIC[8]   = { 'M', 'O', 'E', 'P', 'A', 'C', 'K', '\0' };
static constexpr uint32_t PACK_VERSION    = 1;
static constexpr uint32_t PACK_ALIGN      = 4096;
static constexpr size_t   PACK_HEADER     = 64;
static constexpr size_t   PACK_LAYER      = 40;
static constexpr size_t   PACK_TENSOR     = 144;
static constexpr size_t   PACK_NAME_BYTES = 64;
static constexpr uint64_t PACK_HEADER_MAX = 64ull << 20; // a sane bound on the tables (1e5 tensors take 14 MiB)

llama_expert_pack::~llama_expert_pack() {
    if (file) {
        if (file->fd >= 0) {
            close(file->fd);
        }
        if (file->fd_direct >= 0) {
            close(file->fd_direct);
        }
    }
}

template <typename T>
static T get(const std::vector<char> & b, size_t off) {
    T v;
    memcpy(&v, b.data() + off, sizeof(T));
    return v;
}

static bool pread_all(int fd, std::vector<char> & b, uint64_t off) {
    size_t done = 0;
    while (done < b.size()) {
        const ssize_t r = pread(fd, b.data() + done, b.size() - done, (off_t) (off + done));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return false;
        }
        done += (size_t) r;
    }
    return true;
}

static std::string shape_str(const int64_t * ne) {
    return format("[%lld, %lld, %lld, %lld]", (long long) ne[0], (long long) ne[1], (long long) ne[2], (long long) ne[3]);
}

std::unique_ptr<llama_expert_pack> llama_expert_pack_open(const std::string & path, const llama_expert_file & model,
        int32_t n_expert, const std::vector<std::vector<llama_expert_pack_want>> & want, llama_expert_direct direct,
        std::string & why) {
    const std::string pfx = "expert pack " + path + ": ";
    auto pack = std::make_unique<llama_expert_pack>();
    try {
        pack->file = llama_expert_file_open(path, direct, pfx);
    } catch (const std::exception & e) {
        why = e.what();
        return nullptr;
    }
    llama_expert_file & f = *pack->file;
    std::vector<char> h(PACK_HEADER);
    if (f.size < PACK_HEADER || !pread_all(f.fd, h, 0) || memcmp(h.data(), PACK_MAGIC, sizeof(PACK_MAGIC)) != 0) {
        why = pfx + "not an expert pack (no MOEPACK header)";
        return nullptr;
    }
    const uint32_t version      = get<uint32_t>(h, 8);
    const uint32_t header_bytes = get<uint32_t>(h, 12);
    const uint64_t gguf_size    = get<uint64_t>(h, 16);
    const int64_t  gguf_mtime   = get<int64_t>(h, 24);
    const uint64_t pack_size    = get<uint64_t>(h, 32);
    const uint32_t p_n_expert   = get<uint32_t>(h, 48);
    const uint32_t n_layers     = get<uint32_t>(h, 52);
    const uint32_t n_tensors    = get<uint32_t>(h, 56);
    const uint32_t align        = get<uint32_t>(h, 60);
    if (version != PACK_VERSION) {
        why = pfx + format("version %u, this build reads version %u: write it again with harness pack", version, PACK_VERSION);
        return nullptr;
    }
    const uint64_t need = PACK_HEADER + (uint64_t) PACK_LAYER*n_layers + (uint64_t) PACK_TENSOR*n_tensors;
    if (align != PACK_ALIGN || header_bytes % PACK_ALIGN != 0 || header_bytes < need || header_bytes > PACK_HEADER_MAX) {
        why = pfx + format("damaged header (align %u, header %u bytes for %u layers and %u tensors)", align, header_bytes,
            n_layers, n_tensors);
        return nullptr;
    }
    if (f.size != pack_size) {
        why = pfx + format("%s: %llu bytes, its header says %llu (write it again with harness pack)",
            f.size < pack_size ? "truncated" : "longer than written", (unsigned long long) f.size,
            (unsigned long long) pack_size);
        return nullptr;
    }
    if (gguf_size != model.size) {
        why = pfx + format("written for a model file of %llu bytes, and %s is %llu bytes (a pack of another model, or the "
            "model changed since): write it again with harness pack", (unsigned long long) gguf_size, model.path.c_str(),
            (unsigned long long) model.size);
        return nullptr;
    }
    if (gguf_mtime != model.mtime_ns) {
        why = pfx + format("stale: %s was modified since the pack was written (modification time %lld ns, the pack's "
            "record %lld ns; a copy without its times, or a rewrite): write it again with harness pack (harness pack "
            "--verify compares the bytes)", model.path.c_str(), (long long) model.mtime_ns, (long long) gguf_mtime);
        return nullptr;
    }
    if ((int32_t) p_n_expert != n_expert) {
        why = pfx + format("written for a model of %u experts per layer, this one has %d", p_n_expert, n_expert);
        return nullptr;
    }
    std::vector<char> t(header_bytes);
    if (!pread_all(f.fd, t, 0)) {
        why = pfx + "cannot read its header: " + strerror(errno);
        return nullptr;
    }
    pack->layers.resize(want.size());
    std::vector<bool> layer_seen(want.size(), false);
    for (uint32_t li = 0; li < n_layers; ++li) {
        const size_t   lo           = PACK_HEADER + (size_t) PACK_LAYER*li;
        const uint32_t il           = get<uint32_t>(t, lo);
        const uint32_t nt           = get<uint32_t>(t, lo + 4);
        const uint32_t first        = get<uint32_t>(t, lo + 8);
        const uint64_t record_bytes = get<uint64_t>(t, lo + 16);
        const uint64_t data_bytes   = get<uint64_t>(t, lo + 24);
        const uint64_t first_record = get<uint64_t>(t, lo + 32);
        if ((uint64_t) first + nt > n_tensors || record_bytes % PACK_ALIGN != 0 || first_record % PACK_ALIGN != 0 ||
            first_record < header_bytes || data_bytes > record_bytes ||
            first_record + record_bytes*(uint64_t) n_expert > pack_size) {
            why = pfx + format("damaged header (layer entry %u)", li);
            return nullptr;
        }
        if (il >= want.size() || want[il].empty()) {
            why = pfx + format("it packs layer %u, which has no routed experts in this model (a pack of another model)", il);
            return nullptr;
        }
        const auto & w = want[il];
        if (nt != w.size()) {
            why = pfx + format("layer %u: %u expert tensors packed, the model has %zu (a pack of another model)", il, nt, w.size());
            return nullptr;
        }
        auto & L = pack->layers[il];
        L.first_record = first_record;
        L.record_bytes = record_bytes;
        L.data_bytes   = data_bytes;
        L.rec_offset.assign(w.size(), SIZE_MAX);
        L.size.assign(w.size(), 0);
        layer_seen[il] = true;
        for (uint32_t ti = first; ti < first + nt; ++ti) {
            const size_t to = PACK_HEADER + (size_t) PACK_LAYER*n_layers + (size_t) PACK_TENSOR*ti;
            char name[PACK_NAME_BYTES + 1] = {};
            memcpy(name, t.data() + to, PACK_NAME_BYTES);
            const uint32_t type   = get<uint32_t>(t, to + 64);
            int64_t ne[4];
            for (int d = 0; d < 4; ++d) {
                ne[d] = (int64_t) get<uint64_t>(t, to + 72 + 8*d);
            }
            const uint64_t expert_bytes = get<uint64_t>(t, to + 112);
            const uint64_t rec_offset   = get<uint64_t>(t, to + 120);
            const uint64_t gguf_off     = get<uint64_t>(t, to + 128);
            size_t bi = 0;
            while (bi < w.size() && w[bi].gguf_off != gguf_off) {
                ++bi;
            }
            if (bi == w.size()) {
                why = pfx + format("its tensor %s is at offset %llu of the model file, where layer %u has no expert tensor "
                    "(a pack of another model)", name, (unsigned long long) gguf_off, il);
                return nullptr;
            }
            const auto & b = w[bi];
            if ((int32_t) type != b.type || memcmp(ne, b.ne, sizeof(ne)) != 0 || expert_bytes != b.stride) {
                why = pfx + format("its tensor %s is %s %s, %llu bytes per expert; the model's %s is %s %s, %llu bytes per "
                    "expert (a pack of another model)", name, ggml_type_name((ggml_type) type), shape_str(ne).c_str(),
                    (unsigned long long) expert_bytes, b.name, ggml_type_name((ggml_type) b.type), shape_str(b.ne).c_str(),
                    (unsigned long long) b.stride);
                return nullptr;
            }
            if (L.rec_offset[bi] != SIZE_MAX || rec_offset + expert_bytes > data_bytes) {
                why = pfx + format("damaged header (tensor entry %u)", ti);
                return nullptr;
            }
            L.rec_offset[bi] = (size_t) rec_offset;
            L.size[bi]       = (size_t) expert_bytes;
        }
        // the slices tile the record's data in order (one read scatters into them)
        L.order.resize(w.size());
        for (size_t i = 0; i < w.size(); ++i) {
            L.order[i] = (int32_t) i;
        }
        std::sort(L.order.begin(), L.order.end(), [&](int32_t a, int32_t b) { return L.rec_offset[a] < L.rec_offset[b]; });
        size_t pos = 0;
        for (int32_t i : L.order) {
            if (L.rec_offset[i] != pos) {
                why = pfx + format("damaged header (layer %u's slices do not tile its records)", il);
                return nullptr;
            }
            pos += L.size[i];
        }
        if (pos != data_bytes) {
            why = pfx + format("damaged header (layer %u's slices do not tile its records)", il);
            return nullptr;
        }
    }
    for (size_t il = 0; il < want.size(); ++il) {
        if (!want[il].empty() && !layer_seen[il]) {
            why = pfx + format("layer %zu of the model is not in it (a pack of another model)", il);
            return nullptr;
        }
    }
    return pack;
}

bool llama_expert_pack_read(llama_expert_pack & pack, int32_t il, int32_t e, ggml_tensor * const * dst, int32_t slot) {
    const auto & L = pack.layers[il];
    GGML_ASSERT(L.first_record != 0 && e >= 0);
    llama_expert_read_part parts[16];
    GGML_ASSERT(L.order.size() <= 16);
    size_t n = 0;
    for (int32_t i : L.order) {
        parts[n].dst     = dst[i];
        parts[n].offset  = (size_t) slot*L.size[i];
        parts[n].src_off = L.rec_offset[i];
        parts[n].size    = L.size[i];
        ++n;
    }
    char what[64];
    snprintf(what, sizeof(what), "the record of expert %d of layer %d", e, il);
    return llama_expert_read_file_parts(*pack.file, L.first_record + (uint64_t) e*L.record_bytes, (size_t) L.data_bytes,
        parts, n, what);
}
