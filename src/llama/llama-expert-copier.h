#pragma once

// Copiers (moe-subst, mode=engine): how the engine's copies into the banks are issued and waited for. One interface,
// two implementations in llama-expert-copier.cpp (a second backend instance, host threads).

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-expert-io.h"
#include "llama-expert-pack.h"

#include <cstdint>
#include <memory>
#include <string>

// One copy into a bank: its source (the expert tensor in memory, the model file, or the model file through the RAM
// tier) and its destination (bank, offset, size).
enum llama_expert_transfer_source {
    LLAMA_EXPERT_FROM_MEMORY  = 0, // src, host memory (the expert tensor, or the RAM tier)
    LLAMA_EXPERT_FROM_FILE    = 1, // file at file_off (host=file)
    LLAMA_EXPERT_THROUGH_RAM  = 2, // file at file_off into ram at ram_offset, then those bytes into the bank (three tiers)
    LLAMA_EXPERT_FROM_PACK    = 3, // one read of an expert's record of the expert pack into every bank of its layer
                                   // (banks, at slot), or through the RAM tier (rams, at ram_slot; then copied)
};

struct llama_expert_transfer {
    llama_expert_transfer_source source = LLAMA_EXPERT_FROM_MEMORY;
    ggml_tensor * bank   = nullptr;
    size_t        offset = 0;
    size_t        size   = 0;
    const void *  src    = nullptr; // FROM_MEMORY
    llama_expert_file * file     = nullptr; // FROM_FILE, THROUGH_RAM
    uint64_t            file_off = 0;
    const char *        name     = nullptr; // the expert tensor's name, for a failed read's message
    ggml_tensor *       ram        = nullptr; // THROUGH_RAM
    size_t              ram_offset = 0;
    llama_expert_pack *   pack     = nullptr; // FROM_PACK: the pack, the layer and expert, the layer's banks and slot
    int32_t               il       = -1;
    int32_t               expert   = -1;
    ggml_tensor * const * banks    = nullptr;
    int32_t               slot     = -1;
    ggml_tensor * const * rams     = nullptr; // FROM_PACK through the RAM tier (null: straight into the banks)
    int32_t               ram_slot = -1;
};

// Run a transfer now, in the calling thread. A failed read marks the file (llama_expert_read_file) and returns false;
// so does a failed copy (llama_expert_copy_fault).
bool llama_expert_transfer_run(const llama_expert_transfer & t);

// Test hook: LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER=N fails every transfer into a bank (or the RAM tier) after the
// process's first N, as a device copy that fails would (ggml's backends abort on a real one: nothing else can make
// one). The transfer is not made, one line names it, and from then on every compute of the process's engines ends
// (llama_decode returns 2), as after a failed read. Read once; unset, a transfer pays one comparison.
// copy_fault(t): whether t fails (the copiers ask before each transfer); armed(): whether the hook is set;
// failed()/failure(): whether a transfer has failed, and the first one's message.
bool        llama_expert_copy_fault(const llama_expert_transfer & t);
bool        llama_expert_copy_fault_armed();
bool        llama_expert_copy_failed();
std::string llama_expert_copy_failure();

// Copiers run transfers into the banks. submit() issues one under a mark (one of n_marks); urgent ones (the ubatch's
// fetches) go before the others; record(m) closes mark m over the transfers issued so far (devices with events),
// wait(m) blocks until the transfers issued under m (and, for in-order copiers, before it) have completed,
// wait_all() until every one has. The engine uses two marks per layer: its fetches (waited for at once, one wait for
// all of a step's fetches) and its background admissions (waited for at the next step). One implementation per
// kind, chosen by llama_expert_copier_create; the synchronous copier runs each transfer as it is submitted.
struct llama_expert_copier {
    virtual ~llama_expert_copier() = default;
    virtual void submit(int32_t mark, bool urgent, const llama_expert_transfer & t) = 0;
    virtual void record(int32_t mark) = 0;
    virtual void wait(int32_t mark) = 0;
    virtual void wait_all() = 0;
    virtual const char * name() const = 0;
    // whether submit() returns before the transfer completes (background admissions then overlap the compute)
    virtual bool async() const { return true; }
};

// transfers run at once, in the calling thread
std::unique_ptr<llama_expert_copier> llama_expert_copier_sync();

// a second backend instance of the banks' device: its own stream, one event per mark (CUDA and other
// devices with async copies and events); null when the device offers neither
std::unique_ptr<llama_expert_copier> llama_expert_copier_backend(ggml_backend_dev_t dev, int32_t n_marks);

// n_threads host threads that copy (or read) into banks in host memory, urgent copies first; delay_us (tests)
// holds every copy back so that a slot used before its copy completed would be caught
std::unique_ptr<llama_expert_copier> llama_expert_copier_thread(int32_t n_marks, uint32_t delay_us, int32_t n_threads = 1);

// The factory: the background copier for the banks on dev (async=auto: a copy stream where the device offers async
// copies and events; host=file with banks in host memory, or async=thread: host threads, `readers` of them with
// host=file), logged (as `who`); null when background admissions on dev are synchronous. Throws std::runtime_error
// (prefixed with pfx) for async=thread with banks off the host (il: their layer). direct_reads: for the log line.
// LLAMA_MOE_CACHE_TEST_COPY_DELAY_US (tests) delays every copy of a host thread.
std::unique_ptr<llama_expert_copier> llama_expert_copier_create(ggml_backend_dev_t dev, llama_expert_async async,
        bool host_file, int32_t readers, bool direct_reads, int32_t n_marks, int32_t il, const std::string & pfx,
        const char * who);
