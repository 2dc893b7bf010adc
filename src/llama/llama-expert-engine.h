#pragma once

// The MoE expert cache engine (moe-subst), mode=engine: real cache banks and copies.
//
// Per MoE layer, one bank per routed-expert tensor of the layer (gate/up/down or merged gate_up, and the
// per-expert biases `_b` and scales `_s`): a tensor of the same type and row layout with n_slots + 1
// experts instead of n_expert, slot stride = the expert tensor's stride, allocated in the layer's
// device buffer type (RAM in a CPU build, VRAM with CUDA) and cleared at allocation. The last slot is
// a spare that is never written (kernels may read past the last expert; a dropped expert computes
// with it, with gate weight 0).
//
// The residency policy (llama-expert-policy.h) decides; the engine makes the banks follow it: after the
// policy has decided a token (or a group of tokens), every slot whose bank content differs from the
// policy's residency is copied from the full expert tensor in host memory (consecutive slots holding
// consecutive experts in one copy per bank). A slot the token computes with is fetched synchronously (with a
// copier: all of a step's fetch copies issued, then one wait); a background admission is copied by a copier (a second backend instance with its own stream and an event per
// layer on GPUs; a host thread on request) while the token computes, and the slot stays LOADING, neither used
// nor overwritten, until the layer's next route step has waited for it.

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "llama-expert-copier.h"
#include "llama-expert-io.h"
#include "llama-expert-pack.h"
#include "llama-expert-policy.h"

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

struct llama_model;
struct llama_expert_layer_policy;

// state of a slot: READY (its bank content, possibly empty, may be used), LOADING (a background copy into it
// has been issued and not completed: it must be neither used nor overwritten) or DEFERRED (a background
// admission not issued yet because the slot before it is in use by the ubatch and kernels may read past the
// end of an expert: it is copied synchronously at the layer's next route step, before any use)
enum llama_expert_slot_state {
    LLAMA_EXPERT_SLOT_READY    = 0,
    LLAMA_EXPERT_SLOT_LOADING  = 1,
    LLAMA_EXPERT_SLOT_DEFERRED = 2,
};

struct llama_expert_engine_bank {
    ggml_tensor * src    = nullptr; // the full expert tensor (host memory)
    ggml_tensor * bank   = nullptr; // the cache bank (n_slots + 1 experts)
    size_t        stride = 0;       // bytes per expert (src->nb[dim])

    // host=file: the model file that src is mapped from, and src's offset in it (null: copy from src->data)
    llama_expert_file * file     = nullptr;
    uint64_t            file_off = 0;

    // three tiers: the RAM tier of this tensor (n_ram experts, host memory: pinned where the device has it)
    ggml_tensor * ram = nullptr;
};

struct llama_expert_engine_stats {
    // copied_experts, copies, copy_bytes, copy_ns, ...: the counter table in llama-expert-counters.h
    LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_ZERO)

    void add(const llama_expert_engine_stats & o) {
#define LLAMA_EXPERT_COUNTER_ADD(field, metric, help) field += o.field;
        LLAMA_EXPERT_ENGINE_COUNTERS(LLAMA_EXPERT_COUNTER_ADD)
#undef LLAMA_EXPERT_COUNTER_ADD
    }
};

// a run of consecutive slots that receive consecutive experts, all fetches or all background admissions
struct llama_expert_engine_run {
    int32_t s;  // first slot
    int32_t e;  // first expert
    int32_t n;  // slots
    bool    fg; // fetch (the ubatch computes with it) or background admission
};

struct llama_expert_engine_layer {
    std::vector<llama_expert_engine_bank> banks;
    std::vector<ggml_tensor *> bank_tensors; // banks[i].bank, and banks[i].ram (three tiers), for the expert pack's
    std::vector<ggml_tensor *> ram_tensors;  // one-read transfers
    std::vector<int32_t> bank_expert; // slot -> expert whose bytes the banks hold (-1: empty)
    std::vector<uint8_t> slot_state;  // llama_expert_slot_state per slot
    std::vector<int32_t> loading;     // slots with a background copy in flight, or deferred
    // host=file: the prefetch reads issued into this layer's slots (droppable jobs of the copier), settled at the
    // layer's next route step (settle_prefetch): the expert, its RAM-tier slot and that slot's expert before the
    // prefetch (three tiers; -1: none), and what the job's submission added to the counters (undone when cancelled)
    struct prefetch_read {
        int32_t  slot;
        int32_t  expert;
        int32_t  ram_slot;
        int32_t  ram_before;
        uint64_t copies;
        uint64_t bytes;
    };
    std::vector<prefetch_read> prefetching;
    std::vector<int32_t> ram_expert;  // three tiers: RAM slot -> expert whose bytes the RAM tier holds (-1: empty)
    bool                 ram_pending = false; // three tiers: RAM slot reads in flight (waited for by complete())
    llama_expert_copier * copier = nullptr; // copies into this layer's banks: its device's, or the synchronous one
    std::vector<llama_expert_engine_run> runs; // scratch of sync()

    llama_expert_engine_stats stats;      // since the last reset
    llama_expert_engine_stats stats_init; // initial fill at creation
};

struct llama_expert_engine {
    // Allocate and clear the banks of every MoE layer (moe[il]) in the layer's buffer type.
    // Throws std::runtime_error with a clear message for layouts that cannot be copied slot by slot
    // (repacked CPU weights, expert tensors not in host memory).
    llama_expert_engine(const llama_model & model, const std::vector<bool> & moe, int32_t n_expert, int32_t n_slots,
                        llama_expert_async async, const char * prefix, bool host_file = false, int32_t readers = 1,
                        llama_expert_direct direct = LLAMA_EXPERT_DIRECT_AUTO, int32_t n_ram = 0,
                        const std::string & pack = "");
    ~llama_expert_engine();

    // host=file: the model files the banks read from (path -> file), closed with the engine
    std::map<std::string, std::unique_ptr<llama_expert_file>> files;

    // host=file: the expert pack the banks read whole experts from (one read per expert; llama-expert-pack.h), null
    // when none is used (three reads per expert: one per expert tensor). pack (the spec's pack=): "" = auto, the
    // model file's path + ".moe-pack" when it exists (one that does not match the model: a warning, and reads from
    // the model file); "off"; a path (one that does not match: an error).
    std::unique_ptr<llama_expert_pack> pack;
    void open_pack(const std::string & spec, llama_expert_direct direct, const std::string & pfx);

    // the constructor's steps, in order (llama-expert-engine.cpp says what each does)
    std::map<ggml_backend_buffer_type_t, ggml_context *> make_banks(const llama_model & model,
            const std::vector<bool> & moe, bool host_file, llama_expert_direct direct, const std::string & pfx);
    void alloc_banks(const std::map<ggml_backend_buffer_type_t, ggml_context *> & ctx_of, const std::string & pfx);
    void release_mapped_experts();
    void make_copiers(const llama_model & model, const std::vector<bool> & moe, llama_expert_async async,
            bool host_file, int32_t readers, const std::string & pfx);

    // the bank of a layer's expert tensor; null for null; throws for a tensor without a bank
    ggml_tensor * bank(int32_t il, ggml_tensor * src) const;

    // Copy into the banks every slot whose content differs from the policy's residency. fetched: the experts
    // the current ubatch computes with (its hits, fetches and substitutes): a changed slot holding one of them
    // is a synchronous fetch; any other change is a background admission, LOADING until complete() (DEFERRED,
    // when a copier runs and the slot before it is in use). Null: every change is synchronous (larger
    // ubatches, the prefill bypass, reset).
    // prefetch: the changes are the prefetched experts of route_predict; with host=file and a copier whose prefetches
    // are droppable (host reader threads) each is one droppable prefetch read (one expert, under the layer's prefetch
    // mark), settled by settle_prefetch instead of complete(); otherwise background admissions.
    void sync(int32_t il, const llama_expert_layer_policy & policy, const int32_t * fetched = nullptr, int32_t n_fetched = 0,
              bool prefetch = false);

    // host=file: settle the layer's prefetch reads, after the layer has decided its ubatch (fetched: the experts it
    // computes with; null: all of them count as used) and before sync(): a read not started yet is cancelled (counter
    // prefetch_cancelled); its expert, when the ubatch computes with it, is then read by sync() as a fetch
    // (prefetch_late), and otherwise dropped from the residency (policy.drop_prefetched). One wait for the reads
    // already started (at most one is, the copier runs one prefetch read at a time; prefetch_waits). A synchronous
    // fetch thus never waits for a prefetch read that has not started.
    void settle_prefetch(int32_t il, llama_expert_layer_policy & policy, const int32_t * fetched = nullptr,
                         int32_t n_fetched = 0);

    // complete the layer's background copies (at its next route step, before deciding): wait for the copies
    // in flight, copy the deferred slots
    void complete(int32_t il, const llama_expert_layer_policy & policy);

    // expert -> slot for the expert ops; asserts that the slot holds the expert (copy completed)
    int32_t slot_for(int32_t il, const llama_expert_layer_policy & policy, int32_t expert) const;

    void reset_stats();

    // whether a read from a model file (host=file) or a copy (the test hook llama_expert_copy_fault) has failed
    // (then every compute must end: the banks are not what the policy decided), and the first failure's message
    bool        failed() const;
    std::string failure() const;

    // host=file: whether every model file is still the one opened (llama_expert_file_check), once per ubatch; a file
    // changed in place is marked failed, as a failed read is
    bool check_files();

    // whether any copier runs (background admissions are asynchronous copies)
    bool async() const { return !copiers.empty(); }

    llama_expert_engine_stats total() const;

    // bytes of one expert of layer il in all of its banks (what a copy of it moves)
    uint64_t expert_bytes(int32_t il) const;

    size_t total_size() const;
    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const;

    int32_t n_expert = 0;
    int32_t n_slots  = 0;
    int32_t n_ram    = 0; // three tiers (host=file): the RAM tier's slots per layer; 0: two tiers

    std::vector<llama_expert_engine_layer> layers;

    std::vector<std::unique_ptr<llama_expert_copier>> copiers; // one per device with background copies
    std::unique_ptr<llama_expert_copier>              copier_sync; // the layers without background copies, and the
                                                                   // copies that must complete at once

    std::vector<ggml_context_ptr>        ctxs;
    std::vector<ggml_backend_buffer_ptr> bufs;
    std::vector<std::pair<ggml_backend_buffer_type_t, size_t>> sizes; // bytes of the banks per buffer type

    bool no_alloc = false; // memory fitting dry run: sizes only, nothing copied
    bool warned_pageable = false;
};

