#include "llama-expert-cache-impl.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

// router trace, see docs/expert-cache.md
//

// header: 64 bytes, little-endian
//   char     magic[8]  = "MOETRACE"
//   uint32   version, header_size (64), n_layer, n_expert, k, top_m, record_size, n_slots
//   uint64   model fingerprint (llama-expert-fingerprint.h; 0: none)
//   uint32   reserved[4] = 0
// record (record_size bytes), one per token and MoE layer, in the order decided:
//   uint32   layer, token (index within the layer since the start, or the last reset)
//   int32    ids[k]        selected experts, rank order
//   float32  weights[k]    normalised gate weights
//   int32    used[k]       expert computed with (= ids[r] unless substituted)
//   uint8    action[k]     0 hit, 1 fetch, 2 substitute, 3 drop; padded with zeros to a multiple of 4
//   int32    top_ids[top_m]    the top_m experts by router score, descending
//   float32  top_score[top_m]  their router scores (probability, plus the selection bias if the model has one)
//   int32    pred[k]       version 2: the experts the previous MoE layer predicted for this token-layer (its
//                          input through this layer's router, top k), -1 where there was no prediction

void llama_expert_cache_impl::trace_open() {
    trace = fopen(cfg.trace.c_str(), "wb");
    if (!trace) {
        throw std::runtime_error(std::string(LLAMA_EXPERT_CACHE_ENV) + ": cannot open the trace file '" + cfg.trace + "'");
    }
    const uint32_t k = (uint32_t) n_used;
    trace_rsize = 8 + 12*k + ((k + 3) & ~3u) + 8*trace_top + 4*k;
    uint32_t hdr[14] = {
        LLAMA_EXPERT_TRACE_VERSION, 64, (uint32_t) n_layer, (uint32_t) n_expert, k, trace_top, trace_rsize,
        (uint32_t) n_slots, (uint32_t) trace_fingerprint, (uint32_t) (trace_fingerprint >> 32), 0, 0, 0, 0,
    };
    fwrite("MOETRACE", 1, 8, trace);
    fwrite(hdr, sizeof(hdr), 1, trace);
}

void llama_expert_cache_impl::trace_write(const llama_expert_cache_layer & L, uint32_t token, const int32_t * ids, const float * w,
                                     const int32_t * out, const uint8_t * act, const float * scores, const int32_t * pred) {
    const int32_t k = n_used;
    uint32_t head[2] = { (uint32_t) L.il, token };
    fwrite(head, sizeof(head), 1, trace);
    fwrite(ids, sizeof(int32_t), k, trace);
    fwrite(w,   sizeof(float),   k, trace);
    fwrite(out, sizeof(int32_t), k, trace);
    uint8_t a[4*((LLAMA_MAX_EXPERTS + 3)/4)] = {};
    memcpy(a, act, k);
    fwrite(a, 1, (k + 3) & ~3, trace);

    if (trace_top > 0) {
        auto & top = const_cast<llama_expert_cache_layer &>(L).top;
        top.resize(n_expert);
        for (int32_t e = 0; e < n_expert; ++e) {
            top[e] = e;
        }
        std::partial_sort(top.begin(), top.begin() + trace_top, top.end(), [scores](int32_t a, int32_t b) {
            return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
        });
        fwrite(top.data(), sizeof(int32_t), trace_top, trace);
        for (uint32_t i = 0; i < trace_top; ++i) {
            const float s = scores[top[i]];
            fwrite(&s, sizeof(float), 1, trace);
        }
    }
    if (pred) {
        fwrite(pred, sizeof(int32_t), k, trace);
    } else {
        const int32_t none = -1;
        for (int32_t r = 0; r < k; ++r) {
            fwrite(&none, sizeof(int32_t), 1, trace);
        }
    }
}

//
