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

// the pack's header: magic, version, alignment, its size and the model's size, time and experts against the record
struct pack_header {
    uint32_t version = 0, header_bytes = 0, p_n_expert = 0, n_layers = 0, n_tensors = 0, align = 0;
    uint64_t gguf_size = 0, pack_size = 0;
    int64_t  gguf_mtime = 0;
};

static bool pack_read_header(const llama_expert_file & f, const llama_expert_file & model, int32_t n_expert,
        const std::string & pfx, pack_header & H, std::string & why) {
    std::vector<char> h(PACK_HEADER);
    if (f.size < PACK_HEADER || !pread_all(f.fd, h, 0) || memcmp(h.data(), PACK_MAGIC, sizeof(PACK_MAGIC)) != 0) {
        why = pfx + "not an expert pack (no MOEPACK header)";
        return false;
    }
    H.version      = get<uint32_t>(h, 8);
    H.header_bytes = get<uint32_t>(h, 12);
    H.gguf_size    = get<uint64_t>(h, 16);
    H.gguf_mtime   = get<int64_t>(h, 24);
    H.pack_size    = get<uint64_t>(h, 32);
    H.p_n_expert   = get<uint32_t>(h, 48);
    H.n_layers     = get<uint32_t>(h, 52);
    H.n_tensors    = get<uint32_t>(h, 56);
    H.align        = get<uint32_t>(h, 60);
    if (H.version != PACK_VERSION) {
        why = pfx + format("version %u, this build reads version %u: write it again with harness pack", H.version, PACK_VERSION);
        return false;
    }
    const uint64_t need = PACK_HEADER + (uint64_t) PACK_LAYER*H.n_layers + (uint64_t) PACK_TENSOR*H.n_tensors;
    if (H.align != PACK_ALIGN || H.header_bytes % PACK_ALIGN != 0 || H.header_bytes < need || H.header_bytes > PACK_HEADER_MAX) {
        why = pfx + format("damaged header (align %u, header %u bytes for %u layers and %u tensors)", H.align, H.header_bytes,
            H.n_layers, H.n_tensors);
        return false;
    }
    if (f.size != H.pack_size) {
        why = pfx + format("%s: %llu bytes, its header says %llu (write it again with harness pack)",
            f.size < H.pack_size ? "truncated" : "longer than written", (unsigned long long) f.size,
            (unsigned long long) H.pack_size);
        return false;
    }
    if (H.gguf_size != model.size) {
        why = pfx + format("written for a model file of %llu bytes, and %s is %llu bytes (a pack of another model, or the "
            "model changed since): write it again with harness pack", (unsigned long long) H.gguf_size, model.path.c_str(),
            (unsigned long long) model.size);
        return false;
    }
    if (H.gguf_mtime != model.mtime_ns) {
        why = pfx + format("stale: %s was modified since the pack was written (modification time %lld ns, the pack's "
            "record %lld ns; a copy without its times, or a rewrite): write it again with harness pack (harness pack "
            "--verify compares the bytes)", model.path.c_str(), (long long) model.mtime_ns, (long long) H.gguf_mtime);
        return false;
    }
    if ((int32_t) H.p_n_expert != n_expert) {
        why = pfx + format("written for a model of %u experts per layer, this one has %d", H.p_n_expert, n_expert);
        return false;
    }
    return true;
}

// one tensor entry of layer il's: the model's bank at the same offset, of the same type, shape and stride, and its
// slice within the record
static bool pack_read_tensor(const std::vector<char> & t, uint32_t ti, uint32_t n_layers, uint32_t il,
        uint64_t data_bytes, const std::vector<llama_expert_pack_want> & w, llama_expert_pack_layer & L,
        const std::string & pfx, std::string & why) {
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
        return false;
    }
    const auto & b = w[bi];
    if ((int32_t) type != b.type || memcmp(ne, b.ne, sizeof(ne)) != 0 || expert_bytes != b.stride) {
        why = pfx + format("its tensor %s is %s %s, %llu bytes per expert; the model's %s is %s %s, %llu bytes per "
            "expert (a pack of another model)", name, ggml_type_name((ggml_type) type), shape_str(ne).c_str(),
            (unsigned long long) expert_bytes, b.name, ggml_type_name((ggml_type) b.type), shape_str(b.ne).c_str(),
            (unsigned long long) b.stride);
        return false;
    }
    if (L.rec_offset[bi] != SIZE_MAX || rec_offset + expert_bytes > data_bytes) {
        why = pfx + format("damaged header (tensor entry %u)", ti);
        return false;
    }
    L.rec_offset[bi] = (size_t) rec_offset;
    L.size[bi]       = (size_t) expert_bytes;
    return true;
}

// the slices tile the record's data in order (one read scatters into them)
static bool pack_check_tiling(llama_expert_pack_layer & L, size_t n, uint32_t il, uint64_t data_bytes,
        const std::string & pfx, std::string & why) {
    L.order.resize(n);
    for (size_t i = 0; i < n; ++i) {
        L.order[i] = (int32_t) i;
    }
    std::sort(L.order.begin(), L.order.end(), [&](int32_t a, int32_t b) { return L.rec_offset[a] < L.rec_offset[b]; });
    size_t pos = 0;
    for (int32_t i : L.order) {
        if (L.rec_offset[i] != pos) {
            why = pfx + format("damaged header (layer %u's slices do not tile its records)", il);
            return false;
        }
        pos += L.size[i];
    }
    if (pos != data_bytes) {
        why = pfx + format("damaged header (layer %u's slices do not tile its records)", il);
        return false;
    }
    return true;
}

// layer entry li: its records' place and size, its tensors (pack_read_tensor), their tiling; layer_seen marks it
static bool pack_read_layer(const std::vector<char> & t, uint32_t li, const pack_header & H, int32_t n_expert,
        const std::vector<std::vector<llama_expert_pack_want>> & want, llama_expert_pack & pack,
        std::vector<bool> & layer_seen, const std::string & pfx, std::string & why) {
    const uint32_t n_layers = H.n_layers, n_tensors = H.n_tensors, header_bytes = H.header_bytes;
    const uint64_t pack_size = H.pack_size;
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
        return false;
    }
    if (il >= want.size() || want[il].empty()) {
        why = pfx + format("it packs layer %u, which has no routed experts in this model (a pack of another model)", il);
        return false;
    }
    const auto & w = want[il];
    if (nt != w.size()) {
        why = pfx + format("layer %u: %u expert tensors packed, the model has %zu (a pack of another model)", il, nt, w.size());
        return false;
    }
    auto & L = pack.layers[il];
    L.first_record = first_record;
    L.record_bytes = record_bytes;
    L.data_bytes   = data_bytes;
    L.rec_offset.assign(w.size(), SIZE_MAX);
    L.size.assign(w.size(), 0);
    layer_seen[il] = true;
    for (uint32_t ti = first; ti < first + nt; ++ti) {
        if (!pack_read_tensor(t, ti, n_layers, il, data_bytes, w, L, pfx, why)) {
            return false;
        }
    }
    return pack_check_tiling(L, w.size(), il, data_bytes, pfx, why);
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
    pack_header H;
    if (!pack_read_header(*pack->file, model, n_expert, pfx, H, why)) {
        return nullptr;
    }
    std::vector<char> t(H.header_bytes);
    if (!pread_all(pack->file->fd, t, 0)) {
        why = pfx + "cannot read its header: " + strerror(errno);
        return nullptr;
    }
    pack->layers.resize(want.size());
    std::vector<bool> layer_seen(want.size(), false);
    for (uint32_t li = 0; li < H.n_layers; ++li) {
        if (!pack_read_layer(t, li, H, n_expert, want, *pack, layer_seen, pfx, why)) {
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
