#include "llama-expert-fingerprint.h"

#include "llama-model.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

// 64-bit FNV-1a, numbers as little-endian uint64
struct fnv1a {
    uint64_t h = 0xcbf29ce484222325ULL;

    void bytes(const uint8_t * p, size_t n) {
        for (size_t i = 0; i < n; ++i) {
            h ^= p[i];
            h *= 0x100000001b3ULL;
        }
    }
    void u64(uint64_t v) {
        uint8_t b[8];
        for (int i = 0; i < 8; ++i) {
            b[i] = (uint8_t) (v >> (8*i));
        }
        bytes(b, sizeof(b));
    }
    // an expert weight tensor: ne0, ne1, ne2 and its type
    void tensor(const ggml_tensor * t) {
        if (t != nullptr) {
            u64((uint64_t) t->ne[0]);
            u64((uint64_t) t->ne[1]);
            u64((uint64_t) t->ne[2]);
            u64((uint64_t) t->type);
        }
    }
    uint64_t value() const { return h == 0 ? 1 : h; }
};

const char * const EXPERT_KINDS[] = { "gate", "up", "down", "gate_up" }; // the hash's order

} // namespace

uint64_t llama_expert_fingerprint_of_model(const llama_model & model) {
    fnv1a h;
    const uint32_t n_trunk = std::min<uint32_t>(model.hparams.n_layer(), (uint32_t) model.layers.size());
    std::vector<uint8_t> head;
    for (uint32_t il = 0; il < n_trunk; ++il) {
        const llama_layer & l = model.layers[il];
        const ggml_tensor * exps[] = { l.ffn_gate_exps, l.ffn_up_exps, l.ffn_down_exps, l.ffn_gate_up_exps };
        if (std::all_of(std::begin(exps), std::end(exps), [](const ggml_tensor * t) { return t == nullptr; })) {
            continue;
        }
        const ggml_tensor * router = l.ffn_gate_inp;
        if (router == nullptr || router->buffer == nullptr) {
            return 0; // no router, or no data (a memory-fitting dry run)
        }
        h.u64(il);
        for (const ggml_tensor * t : exps) {
            h.tensor(t);
        }
        const size_t size = ggml_nbytes(router);
        head.resize(std::min<size_t>(size, LLAMA_EXPERT_FINGERPRINT_ROUTER_BYTES));
        ggml_backend_tensor_get(router, head.data(), 0, head.size());
        h.u64(size);
        h.bytes(head.data(), head.size());
    }
    return h.value();
}

// an integer metadata value of any integer type; def when absent
static uint64_t gguf_uint(const gguf_context * g, const std::string & key, uint64_t def) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) {
        return def;
    }
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8:   return (uint64_t) std::max<int8_t>(0, gguf_get_val_i8(g, id));
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16:  return (uint64_t) std::max<int16_t>(0, gguf_get_val_i16(g, id));
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return (uint64_t) std::max<int32_t>(0, gguf_get_val_i32(g, id));
        case GGUF_TYPE_UINT64: return gguf_get_val_u64(g, id);
        case GGUF_TYPE_INT64:  return (uint64_t) std::max<int64_t>(0, gguf_get_val_i64(g, id));
        default:               return def;
    }
}

bool llama_expert_fingerprint_of_file(const std::string & path, uint64_t & fp, std::string & err) {
    err.clear();
    {
        // not a GGUF file at all: one line here, not gguf's own log line first
        char magic[4] = {};
        FILE * f = fopen(path.c_str(), "rb");
        const bool opened = f != nullptr;
        const bool gguf = opened && fread(magic, 1, 4, f) == 4 && memcmp(magic, "GGUF", 4) == 0;
        if (opened) {
            fclose(f);
        }
        if (!gguf) {
            err = "cannot read the model '" + path + "' (" + (opened ? "not a GGUF file" : strerror(errno)) + ")";
            return false;
        }
    }
    ggml_context * meta = nullptr;
    gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ &meta };
    gguf_context * g = gguf_init_from_file(path.c_str(), params);
    if (g == nullptr) {
        err = "cannot read the model '" + path + "' (a damaged GGUF file)";
        return false;
    }
    FILE * f = fopen(path.c_str(), "rb");
    const int64_t arch_id = gguf_find_key(g, "general.architecture");
    const std::string arch = arch_id >= 0 && gguf_get_kv_type(g, arch_id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, arch_id) : "";
    const uint64_t n_layer = gguf_uint(g, arch + ".block_count", 0);
    const uint64_t n_nextn = gguf_uint(g, arch + ".nextn_predict_layers", 0);
    const uint64_t n_trunk = n_nextn < n_layer ? n_layer - n_nextn : n_layer;

    fnv1a h;
    bool moe = false;
    std::vector<uint8_t> head;
    char name[128];
    for (uint64_t il = 0; il < n_trunk && err.empty(); ++il) {
        const ggml_tensor * exps[4] = {};
        bool any = false;
        for (int i = 0; i < 4; ++i) {
            for (const char * role : { "weight", "bias", "scale" }) {
                snprintf(name, sizeof(name), "blk.%llu.ffn_%s_exps.%s", (unsigned long long) il, EXPERT_KINDS[i], role);
                const ggml_tensor * t = ggml_get_tensor(meta, name);
                any = any || t != nullptr;
                if (t != nullptr && role[0] == 'w') {
                    exps[i] = t;
                }
            }
        }
        if (!any) {
            continue;
        }
        moe = true;
        snprintf(name, sizeof(name), "blk.%llu.ffn_gate_inp.weight", (unsigned long long) il);
        const int64_t router = gguf_find_tensor(g, name);
        if (router < 0) {
            err = "the model '" + path + "' has no router in MoE layer " + std::to_string(il) + " (" + name + ")";
            break;
        }
        h.u64(il);
        for (const ggml_tensor * t : exps) {
            h.tensor(t);
        }
        const size_t size = gguf_get_tensor_size(g, router);
        head.resize(std::min<size_t>(size, LLAMA_EXPERT_FINGERPRINT_ROUTER_BYTES));
        const size_t off = gguf_get_data_offset(g) + gguf_get_tensor_offset(g, router);
        if (f == nullptr || fseek(f, (long) off, SEEK_SET) != 0 || fread(head.data(), 1, head.size(), f) != head.size()) {
            err = "cannot read the router weights " + std::string(name) + " of the model '" + path + "' (truncated?)";
            break;
        }
        h.u64(size);
        h.bytes(head.data(), head.size());
    }
    if (err.empty() && !moe) {
        err = "the model '" + path + "' has no routed experts (not a Mixture-of-Experts model)";
    }
    if (f != nullptr) {
        fclose(f);
    }
    gguf_free(g);
    ggml_free(meta);
    fp = h.value();
    return err.empty();
}
