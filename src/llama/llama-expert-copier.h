#pragma once

// Copiers (moe-subst, mode=engine): how the engine's copies into the banks are issued and waited for. One interface,
// two implementations in llama-expert-copier.cpp (a second backend instance, host threads).

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-expert-io.h"

#include <cstdint>
#include <memory>

// Copies into the banks. copy() and read() issue one under a mark (one of n_marks); urgent ones (the ubatch's
// fetches) go before the others; record(m) closes mark m over the copies issued so far (devices with events),
// wait(m) blocks until the copies issued under m (and, for in-order copiers, before it) have completed,
// wait_all() until every copy has. The engine uses two marks per layer: its fetches (waited for at once, one wait
// for all of a step's fetch copies) and its background admissions (waited for at the next step).
struct llama_expert_copier {
    virtual ~llama_expert_copier() = default;
    virtual void copy(int32_t mark, bool urgent, ggml_tensor * bank, const void * src, size_t offset, size_t size) = 0;
    // host=file: the same as a copy, from the model file; by default read synchronously
    virtual void read(int32_t mark, bool urgent, ggml_tensor * bank, llama_expert_file & f, uint64_t file_off,
                      size_t offset, size_t size, const char * tensor_name) {
        (void) mark; (void) urgent;
        (void) llama_expert_read_file(bank, f, file_off, offset, size, tensor_name); // a failure marks f
    }
    // three tiers: read from the model file into the RAM tier (ram, host memory) at ram_offset, then copy those
    // bytes into bank at offset; by default synchronously
    virtual void read_through(int32_t mark, bool urgent, ggml_tensor * ram, llama_expert_file & f, uint64_t file_off,
                              size_t ram_offset, size_t size, const char * tensor_name, ggml_tensor * bank,
                              size_t offset) {
        (void) mark; (void) urgent;
        if (llama_expert_read_file(ram, f, file_off, ram_offset, size, tensor_name)) {
            ggml_backend_tensor_set(bank, (const char *) ram->data + ram_offset, offset, size);
        }
    }
    virtual void record(int32_t mark) = 0;
    virtual void wait(int32_t mark) = 0;
    virtual void wait_all() = 0;
    virtual const char * name() const = 0;
};

// a second backend instance of the banks' device: its own stream, one event per mark (CUDA and other
// devices with async copies and events); null when the device offers neither
std::unique_ptr<llama_expert_copier> llama_expert_copier_backend(ggml_backend_dev_t dev, int32_t n_marks);

// n_threads host threads that copy (or read) into banks in host memory, urgent copies first; delay_us (tests)
// holds every copy back so that a slot used before its copy completed would be caught
std::unique_ptr<llama_expert_copier> llama_expert_copier_thread(int32_t n_marks, uint32_t delay_us, int32_t n_threads = 1);
