#pragma once

// The expert pack (moe-subst, host=file): an expert-major copy of a model's routed experts written by `harness
// pack` next to the model (MODEL.moe-pack), each expert's slices of all of its layer's expert tensors in one
// 4 KiB-aligned record, so that a missed expert is one read instead of one per tensor. The format is
// harness/domain/pack.py's (docs/expert-cache-engine.md, "Expert pack"): this file opens it, checks it against the
// loaded model and reads records.

#include "ggml.h"
#include "llama-expert-io.h"
#include "llama-expert-spec.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// a packed layer, as the engine's banks of that layer see it (slices in the order of the layer's banks)
struct llama_expert_pack_layer {
    uint64_t             first_record = 0; // file offset of expert 0's record; 0: the layer is not packed
    uint64_t             record_bytes = 0; // a record's stride in the pack (a multiple of 4 KiB)
    uint64_t             data_bytes   = 0; // the bytes of a record that are read (the slices, back to back)
    std::vector<size_t>  rec_offset;       // per bank: where its slice starts in a record
    std::vector<size_t>  size;             // per bank: its slice's bytes (the bank's stride)
    std::vector<int32_t> order;            // bank indices in record order
};

struct llama_expert_pack {
    std::unique_ptr<llama_expert_file>   file;
    std::vector<llama_expert_pack_layer> layers; // by layer index
    ~llama_expert_pack();
};

// one bank that the pack must serve: its layer, the expert tensor's offset in the model file, type, shape and stride
struct llama_expert_pack_want {
    uint64_t     gguf_off = 0;
    int32_t      type     = 0;
    int64_t      ne[4]    = { 1, 1, 1, 1 };
    uint64_t     stride   = 0;
    const char * name     = nullptr;
};

// Open the pack at path and check it against the loaded model file (model: its size and modification time as the
// engine opened it), n_expert and the banks wanted (want[il]: layer il's banks in their order; empty for layers
// without banks): magic, version, the pack's size against its header's (truncated), the model's size and
// modification time against those recorded (stale: the model changed since the pack was written), every wanted
// tensor at the same offset with the same type, shape and stride and no other (a pack of another model). Returns null
// and sets why (one line naming the pack and what differs) when it does not match or cannot be read. The expert
// bytes' checksum is not read here (a full read of the experts: `harness pack --verify` checks it).
std::unique_ptr<llama_expert_pack> llama_expert_pack_open(const std::string & path, const llama_expert_file & model,
        int32_t n_expert, const std::vector<std::vector<llama_expert_pack_want>> & want, llama_expert_direct direct,
        std::string & why);

// One read of expert e's record of layer il into slot `slot` of dst[i], dst in the order of the layer's banks (the
// banks, or the RAM tier's tensors). False on a failed read (llama_expert_read_file_parts: the pack file marked failed).
bool llama_expert_pack_read(llama_expert_pack & pack, int32_t il, int32_t e, ggml_tensor * const * dst, int32_t slot);
