#include "llama-expert-engine.h"
#include "llama-expert-mapping.h"

#include "llama-expert-measure.h"

#include "llama-expert-policy.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <fstream>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

llama_expert_engine::llama_expert_engine(const llama_model & model, const std::vector<bool> & moe, int32_t n_expert_,
                                         int32_t n_slots_, llama_expert_async async, const char * prefix, bool host_file,
                                         int32_t readers, llama_expert_direct direct, int32_t n_ram_,
                                         const std::string & pack_spec)
        : n_expert(n_expert_), n_slots(n_slots_), n_ram(host_file ? n_ram_ : 0) {
    const std::string pfx = prefix;
    no_alloc = model.hparams.no_alloc;
    layers.resize(moe.size());
    alloc_banks(make_banks(model, moe, host_file, direct, pfx), pfx);
    if (host_file && !no_alloc && pack_spec != "off") {
        open_pack(pack_spec, direct, pfx);
    }
    if (host_file && !no_alloc) {
        release_mapped_experts();
    }
    make_copiers(model, moe, async, host_file, readers, pfx);
}

// the bank (n_slots + 1 spare) and RAM-tier tensors of every MoE layer, in a ggml context per buffer type (no data
// yet); host=file: the model files they read from, opened. Throws for layouts that cannot be copied slot by slot
std::map<ggml_backend_buffer_type_t, ggml_context *> llama_expert_engine::make_banks(const llama_model & model,
        const std::vector<bool> & moe, bool host_file, llama_expert_direct direct, const std::string & pfx) {
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_of;
    auto ctx_for = [&](ggml_backend_buffer_type_t buft) {
        auto it = ctx_of.find(buft);
        if (it == ctx_of.end()) {
            ggml_init_params params = {
                /*.mem_size   =*/ 2*moe.size()*LLAMA_EXPERT_N_TENSORS*ggml_tensor_overhead(), // banks and RAM tiers
                /*.mem_buffer =*/ nullptr,
                /*.no_alloc   =*/ true,
            };
            ggml_context * ctx = ggml_init(params);
            if (!ctx) {
                throw std::runtime_error(pfx + "failed to create the ggml context of the cache banks");
            }
            ctxs.emplace_back(ctx);
            it = ctx_of.emplace(buft, ctx).first;
        }
        return it->second;
    };

    for (size_t il = 0; il < moe.size(); ++il) {
        if (!moe[il]) {
            continue;
        }
        const auto srcs = llama_expert_layer_tensors(model.layers[il]);
        // the banks would be on a remote device: every fetch a network round trip, and no copy stream (issue 24 item 4)
        const std::string remote = llama_expert_remote_dev(llama_expert_layer_dev(model, (int) il));
        if (!remote.empty()) {
            throw std::runtime_error(pfx + "mode=engine does not serve layers on a remote device, and layer " +
                std::to_string(il) + " is on " + remote + " (ggml-rpc): keep the MoE layers local (no --rpc, or "
                "-ot/--tensor-split), or run these layers stock (mode=off; mode=emulate works)");
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(llama_expert_layer_dev(model, (int) il));
        ggml_context * ctx = ctx_for(buft);
        // three tiers: the RAM tier in the device's pinned host memory (fast asynchronous copies to a GPU), else RAM
        ggml_backend_buffer_type_t ram_buft = ggml_backend_dev_host_buffer_type(llama_expert_layer_dev(model, (int) il));
        if (ram_buft == nullptr) {
            ram_buft = ggml_backend_cpu_buffer_type();
        }
        for (ggml_tensor * src : srcs) {
            if (src == nullptr) {
                continue;
            }
            if (src->buffer == nullptr || !ggml_backend_buffer_is_host(src->buffer)) {
                const char * bname = src->buffer ? ggml_backend_buffer_name(src->buffer) : "none";
                const bool repack = src->buffer && strstr(bname, "REPACK") != nullptr;
                throw std::runtime_error(pfx + "mode=engine copies experts slot by slot from host memory, but " +
                    ggml_get_name(src) + " is in buffer " + bname +
                    (repack ? " (repacked CPU layout): pass --no-repack (-nr) to load the weights in their plain layout"
                            : ", not host memory: keep the expert tensors in RAM (--cpu-moe, or -ot exps=CPU)"));
            }
            // copies to a GPU are fast and asynchronous only from pinned memory
            ggml_backend_buffer_type_t host_buft = ggml_backend_dev_host_buffer_type(llama_expert_layer_dev(model, (int) il));
            if (host_buft && ggml_backend_buffer_get_type(src->buffer) != host_buft && !warned_pageable) {
                LLAMA_LOG_WARN("%s: WARNING: the expert tensors (e.g. %s, in %s) are in pageable host memory, not in "
                    "%s: every fetch into the cache is a slower, synchronous copy. To load them into pinned memory, "
                    "load without mmap (--load-mode none; llama-bench: -lm none) and keep the experts on the CPU (--cpu-moe)\n",
                    "llama_expert_engine", ggml_get_name(src), ggml_backend_buffer_name(src->buffer), ggml_backend_buft_name(host_buft));
                warned_pageable = true;
            }
            const int d = llama_expert_dim(src);
            if (src->ne[d] != n_expert || !ggml_is_contiguous(src)) {
                throw std::runtime_error(pfx + "unsupported layout of the expert tensor " + ggml_get_name(src) +
                    " (expected a contiguous tensor whose last dimension is the " + std::to_string(n_expert) + " experts)");
            }
            int64_t ne[GGML_MAX_DIMS];
            for (int i = 0; i < GGML_MAX_DIMS; ++i) {
                ne[i] = src->ne[i];
            }
            ne[d] = n_slots + 1; // one spare slot, never written
            ggml_tensor * bank = ggml_new_tensor(ctx, src->type, ggml_n_dims(src), ne);
            ggml_format_name(bank, "%s.cache", ggml_get_name(src));
            GGML_ASSERT(bank->nb[d] == src->nb[d]);
            llama_expert_engine_bank eb;
            eb.src = src; eb.bank = bank; eb.stride = src->nb[d];
            if (n_ram > 0) {
                ne[d] = n_ram;
                eb.ram = ggml_new_tensor(ctx_for(ram_buft), src->type, ggml_n_dims(src), ne);
                ggml_format_name(eb.ram, "%s.ram", ggml_get_name(src));
            }
            if (host_file && !model.hparams.no_alloc) { // (not in a memory-fitting dry run: nothing is mapped then)
                std::string path;
                if (!llama_expert_mapped_file_of(src->data, path, eb.file_off)) {
                    throw std::runtime_error(pfx + "host=file reads experts from the model file, but " + ggml_get_name(src) +
                        " is not mapped from a file: load the model with mmap (the default; no --no-mmap, no --load-mode none)");
                }
                auto f = files.find(path);
                if (f == files.end()) {
                    f = files.emplace(path, llama_expert_file_open(path, direct, pfx)).first;
                }
                eb.file = f->second.get();
                eb.file->piece = std::max(eb.file->piece, (size_t) eb.stride); // runs are read a slice at a time
            }
            layers[il].banks.push_back(eb);
        }
        for (const auto & b : layers[il].banks) {
            layers[il].bank_tensors.push_back(b.bank);
            layers[il].ram_tensors.push_back(b.ram);
        }
        layers[il].bank_expert.assign(n_slots, -1);
        layers[il].slot_state.assign(n_slots, LLAMA_EXPERT_SLOT_READY);
        layers[il].ram_expert.assign(n_ram, -1);
    }
    return ctx_of;
}

// the banks' buffers, one per buffer type, cleared (a memory-fitting dry run: dummy buffers, nothing allocated)
void llama_expert_engine::alloc_banks(const std::map<ggml_backend_buffer_type_t, ggml_context *> & ctx_of,
        const std::string & pfx) {
    for (auto & [buft, ctx] : ctx_of) {
        ggml_backend_buffer_t buf;
        const size_t size = ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft);
        if (no_alloc) {
            // memory fitting dry run: a dummy buffer, so that the scheduler does not allocate the banks
            buf = ggml_backend_buft_alloc_buffer(buft, 0);
            for (ggml_tensor * t = ggml_get_first_tensor(ctx); t != nullptr; t = ggml_get_next_tensor(ctx, t)) {
                t->buffer = buf;
            }
        } else {
            buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        }
        if (!buf) {
            throw std::runtime_error(pfx + "failed to allocate " + std::to_string(size/1024/1024) +
                " MiB for the cache banks in " + ggml_backend_buft_name(buft) + ": give fewer slots");
        }
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        if (!no_alloc) {
            ggml_backend_buffer_clear(buf, 0);
        }
        LLAMA_LOG_INFO("%s: cache banks: %8.2f MiB in %s (%d slots + 1 spare per layer)\n", "llama_expert_engine",
            size/1024.0/1024.0, ggml_backend_buft_name(buft), n_slots);
        bufs.emplace_back(buf);
        sizes.emplace_back(buft, size);
    }
}

// host=file: the mapped expert tensors' pages dropped (the banks never read them), and the non-expert weights' faults
// kept from reading ahead into the experts
void llama_expert_engine::release_mapped_experts() {
    // the expert tensors stay mapped but are never read by the banks: drop their pages (the loader may have
    // populated the mapping), so that they cost no RAM; stock-path ubatches (prefill) fault them in again
    const uintptr_t page = (uintptr_t) sysconf(_SC_PAGESIZE);
    uint64_t released = 0;
    for (const auto & L : layers) {
        for (const auto & b : L.banks) {
            const uintptr_t lo = (uintptr_t) b.src->data & ~(page - 1);
            const uintptr_t hi = (uintptr_t) b.src->data + ggml_nbytes(b.src);
            madvise((void *) lo, hi - lo, MADV_DONTNEED);
            posix_fadvise(b.file->fd, (off_t) b.file_off, (off_t) ggml_nbytes(b.src), POSIX_FADV_DONTNEED);
            released += ggml_nbytes(b.src);
        }
    }
    LLAMA_LOG_INFO("%s: host=file: missed experts are read from %zu model file(s); %.1f MiB of mapped expert "
        "tensors released from memory\n", "llama_expert_engine", files.size(), released/1024.0/1024.0);
    // the non-expert weights stay mapped: their faults must not read ahead into the experts
    // (llama-expert-mapping.h)
    std::map<const llama_expert_file *, std::pair<uintptr_t, std::vector<std::pair<uint64_t, uint64_t>>>> by_file;
    for (const auto & L : layers) {
        for (const auto & b : L.banks) {
            auto & e = by_file[b.file];
            e.first = (uintptr_t) b.src->data - b.file_off;
            e.second.emplace_back(b.file_off, ggml_nbytes(b.src));
        }
    }
    llama_expert_mapping_confined conf;
    for (auto & [f, e] : by_file) {
        const auto c = llama_expert_mapping_confine(e.first, f->size, std::move(e.second));
        conf.bytes += c.bytes; conf.ranges += c.ranges; conf.failed += c.failed;
    }
    LLAMA_LOG_INFO("%s: host=file: %.1f MiB of non-expert weights in %d mapped ranges read without readahead "
        "into the experts (MADV_RANDOM)%s\n", "llama_expert_engine", conf.bytes/1024.0/1024.0, conf.ranges,
        conf.failed ? "; madvise refused some ranges, left as they were" : "");
}

void llama_expert_engine::make_copiers(const llama_model & model, const std::vector<bool> & moe,
        llama_expert_async async, bool host_file, int32_t readers, const std::string & pfx) {
    // background copies: one copier per device of the banks. host=file: reads from the disk are worth overlapping
    // on any device, so async=auto reads background admissions in a host thread where the banks are in host memory
    // every layer has a copier: its device's background copier (llama_expert_copier_create), else the synchronous one
    copier_sync = llama_expert_copier_sync();
    std::map<ggml_backend_dev_t, llama_expert_copier *> copier_of;
    for (size_t il = 0; il < moe.size(); ++il) {
        if (!moe[il]) {
            continue;
        }
        layers[il].copier = copier_sync.get();
        if (no_alloc) {
            continue;
        }
        ggml_backend_dev_t dev = llama_expert_layer_dev(model, (int) il);
        auto it = copier_of.find(dev);
        if (it == copier_of.end()) {
            auto c = llama_expert_copier_create(dev, async, host_file, readers,
                files.empty() || files.begin()->second->direct, 3*(int32_t) moe.size(), (int32_t) il, pfx, "llama_expert_engine");
            llama_expert_copier * ptr = c ? c.get() : copier_sync.get();
            if (c) {
                copiers.push_back(std::move(c));
            }
            it = copier_of.emplace(dev, ptr).first;
        }
        layers[il].copier = it->second;
    }
}

void llama_expert_engine::open_pack(const std::string & spec, llama_expert_direct direct, const std::string & pfx) {
    const bool given = !spec.empty() && spec != "auto";
    if (files.size() != 1) {
        // a split model: a pack is written for one GGUF file
        if (given) {
            throw std::runtime_error(pfx + "pack=" + spec + ": an expert pack serves a model in one file, and the "
                "experts of this one are in " + std::to_string(files.size()) + " files: remove pack=");
        }
        return;
    }
    const llama_expert_file & model_file = *files.begin()->second;
    const std::string path = given ? spec : model_file.path + ".moe-pack";
    if (!given && access(path.c_str(), F_OK) != 0) {
        LLAMA_LOG_INFO("%s: host=file: no expert pack at %s: each missed expert is one read per expert tensor "
            "(harness pack writes one)\n", __func__, path.c_str());
        return;
    }
    std::vector<std::vector<llama_expert_pack_want>> want(layers.size());
    for (size_t il = 0; il < layers.size(); ++il) {
        for (const auto & b : layers[il].banks) {
            llama_expert_pack_want w;
            w.gguf_off = b.file_off;
            w.type     = (int32_t) b.src->type;
            for (int d = 0; d < 4; ++d) {
                w.ne[d] = b.src->ne[d];
            }
            w.stride = b.stride;
            w.name   = ggml_get_name(b.src);
            want[il].push_back(w);
        }
    }
    std::string why;
    pack = llama_expert_pack_open(path, model_file, n_expert, want, direct, why);
    if (!pack) {
        if (given) {
            throw std::runtime_error(pfx + "pack=" + spec + ": " + why);
        }
        LLAMA_LOG_WARN("%s: WARNING: %s; it is not used: each missed expert is one read per expert tensor\n",
            __func__, why.c_str());
        return;
    }
    LLAMA_LOG_INFO("%s: host=file: expert pack %s: one read per missed expert\n", __func__, path.c_str());
}

llama_expert_engine::~llama_expert_engine() {
    // no copy may outlive the banks it writes
    for (auto & c : copiers) {
        c->wait_all();
    }
    copiers.clear();
    for (auto & [path, f] : files) {
        close(f->fd);
        if (f->fd_direct >= 0) {
            close(f->fd_direct);
        }
    }
}

ggml_tensor * llama_expert_engine::bank(int32_t il, ggml_tensor * src) const {
    if (src == nullptr) {
        return nullptr;
    }
    for (const auto & b : layers.at(il).banks) {
        if (b.src == src) {
            return b.bank;
        }
    }
    throw std::runtime_error(format("expert cache: layer %d computes its experts with %s, which mode=engine has no "
        "cache bank for (it banks ffn_{gate,up,down,gate_up}_exps and their biases and scales): use mode=emulate, or run "
        "without the cache (unset LLAMA_MOE_CACHE, or mode=off)", il, ggml_get_name(src)));
}

// the copiers' marks of a layer: its fetches (waited for at once), its background admissions (waited for at its next
// step) and its droppable prefetch reads (host=file: settled at its next step, llama_expert_engine::settle_prefetch)
static int32_t mark_fetch(int32_t il)    { return 3*il; }
static int32_t mark_bg(int32_t il)       { return 3*il + 1; }
static int32_t mark_prefetch(int32_t il) { return 3*il + 2; }

// copy experts e .. e+n-1 into slots s .. s+n-1 of every bank of the layer, one transfer per bank submitted to copier
// (the layer's, or the synchronous one); from the expert pack (host=file with a pack), one transfer per expert (one
// read into all of its banks). prefetch (runs of one expert): the transfers are one droppable prefetch job, tagged
// with the slot.
static void copy_run(llama_expert_engine_layer & L, int32_t il, const llama_expert_layer_policy & policy, int32_t s,
                     int32_t e, int32_t n, llama_expert_copier & copier, bool fg, llama_expert_pack * pack,
                     bool prefetch = false) {
    GGML_ASSERT(!prefetch || (n == 1 && !fg));
    const int32_t mark = fg ? mark_fetch(il) : prefetch ? mark_prefetch(il) : mark_bg(il);
    llama_expert_transfer pf_ts[LLAMA_EXPERT_N_TENSORS];
    int32_t               pf_n = 0;
    auto submit = [&](const llama_expert_transfer & t) {
        if (prefetch) {
            GGML_ASSERT(pf_n < (int32_t) LLAMA_EXPERT_N_TENSORS);
            pf_ts[pf_n++] = t;
        } else {
            copier.submit(mark, fg, t);
        }
    };
    // three tiers (runs of one expert): from the RAM tier when it holds the expert's bytes; through it (read from
    // the file into its slot, then copied) when the policy has just put the expert there; else from the file
    const bool    tiered  = !L.ram_expert.empty();
    GGML_ASSERT(!tiered || n == 1);
    const int32_t s2      = tiered ? policy.ram_slot_of(e) : -1;
    const bool    from_ram = s2 >= 0 && L.ram_expert[s2] == e;
    const bool    through  = s2 >= 0 && !from_ram;
    if (pack && !from_ram && !L.banks.empty() && L.banks[0].file != nullptr) {
        // the expert pack: one read per expert into all of its banks (through the RAM tier's slot when tiered)
        for (int32_t i = 0; i < n; ++i) {
            llama_expert_transfer t;
            t.source   = LLAMA_EXPERT_FROM_PACK;
            t.bank     = L.bank_tensors[0]; // (for a failed copy's message)
            t.size     = (size_t) pack->layers[il].data_bytes;
            t.pack     = pack;
            t.il       = il;
            t.expert   = e + i;
            t.banks    = L.bank_tensors.data();
            t.slot     = s + i;
            t.rams     = through ? L.ram_tensors.data() : nullptr;
            t.ram_slot = s2;
            submit(t);
            L.stats.copies++;
            L.stats.copy_bytes += (uint64_t) t.size;
        }
    } else {
        for (const auto & b : L.banks) {
            llama_expert_transfer t;
            t.bank   = b.bank;
            t.offset = (size_t) s*b.stride;
            t.size   = (size_t) n*b.stride;
            if (from_ram) {
                t.src = (const char *) b.ram->data + (size_t) s2*b.stride;
            } else if (b.file != nullptr) { // host=file
                t.source     = through ? LLAMA_EXPERT_THROUGH_RAM : LLAMA_EXPERT_FROM_FILE;
                t.file       = b.file;
                t.file_off   = b.file_off + (uint64_t) e*b.stride;
                t.name       = ggml_get_name(b.src);
                t.ram        = b.ram;
                t.ram_offset = (size_t) s2*b.stride;
            } else {
                t.src = (const char *) b.src->data + (size_t) e*b.stride;
            }
            submit(t);
            L.stats.copies++;
            L.stats.copy_bytes += (uint64_t) t.size;
        }
    }
    if (prefetch) {
        copier.submit_prefetch(mark, s, pf_ts, pf_n);
    }
    if (through) {
        L.ram_expert[s2] = e;
    }
    for (int32_t i = 0; i < n; ++i) {
        L.bank_expert[s + i] = e + i;
    }
    L.stats.copied_experts += n;
}

// three tiers: fill the RAM slots whose expert the policy changed and no slot copy of this step read through
// (background reads where a copier runs: waited for at the layer's next step, before any copy from them)
static void fill_ram(llama_expert_engine_layer & L, int32_t il, const llama_expert_layer_policy & policy,
                     llama_expert_copier & copier, llama_expert_pack * pack) {
    for (int32_t s2 = 0; s2 < (int32_t) L.ram_expert.size(); ++s2) {
        const int32_t e = policy.ram_expert_of(s2);
        if (e < 0) {
            L.ram_expert[s2] = -1; // emptied by the policy (a reset): forgotten, so reads follow the policy's count
            continue;
        }
        if (L.ram_expert[s2] == e) {
            continue;
        }
        if (pack) {
            llama_expert_transfer t;
            t.source = LLAMA_EXPERT_FROM_PACK;
            t.bank   = L.ram_tensors[0];
            t.size   = (size_t) pack->layers[il].data_bytes;
            t.pack   = pack;
            t.il     = il;
            t.expert = e;
            t.banks  = L.ram_tensors.data();
            t.slot   = s2;
            copier.submit(mark_bg(il), false, t);
            L.ram_expert[s2] = e;
            continue;
        }
        for (const auto & b : L.banks) {
            llama_expert_transfer t;
            t.source   = LLAMA_EXPERT_FROM_FILE;
            t.bank     = b.ram;
            t.offset   = (size_t) s2*b.stride;
            t.size     = b.stride;
            t.file     = b.file;
            t.file_off = b.file_off + (uint64_t) e*b.stride;
            t.name     = ggml_get_name(b.src);
            copier.submit(mark_bg(il), false, t);
        }
        L.ram_expert[s2] = e;
    }
}

void llama_expert_engine::sync(int32_t il, const llama_expert_layer_policy & policy, const int32_t * fetched, int32_t n_fetched,
                               bool prefetch) {
    if (no_alloc) {
        return;
    }
    auto & L = layers[il];
    // host=file with host reader threads: each prefetched expert one droppable read (runs of one expert)
    const bool pf_drop = prefetch && !files.empty() && L.copier->prefetch_droppable();
    const auto t_start = std::chrono::steady_clock::now();

    // a slot whose new expert the current ubatch computes with is a synchronous fetch; any other change is a
    // background admission (all changes are foreground when fetched is null: larger ubatches, bypass, reset)
    auto is_fetch = [&](int32_t e) {
        if (fetched == nullptr) {
            return true;
        }
        for (int32_t i = 0; i < n_fetched; ++i) {
            if (fetched[i] == e) {
                return true;
            }
        }
        return false;
    };
    // a slot the ubatch's expert ops read (its expert is computed with); kernels that read past the end of an
    // expert (MMQ tiles) may read the start of the next slot, which no copy may write while they run
    auto in_use = [&](int32_t slot) {
        const int32_t e = policy.expert_of(slot);
        return e >= 0 && fetched != nullptr && is_fetch(e);
    };

    // the runs of consecutive slots that need consecutive experts of the same kind (fetch or background)
    auto & runs = L.runs;
    runs.clear();
    int32_t s = 0;
    while (s < n_slots) {
        const int32_t e = policy.expert_of(s);
        if (e < 0 || L.bank_expert[s] == e) {
            ++s;
            continue;
        }
        GGML_ASSERT(L.slot_state[s] == LLAMA_EXPERT_SLOT_READY && "expert cache engine: a slot overwritten while its copy runs");
        const bool fg = is_fetch(e);
        if (!fg && L.copier->async() && s > 0 && in_use(s - 1)) {
            // next to a slot in use: copied synchronously at the layer's next route step, before any use
            L.slot_state[s] = LLAMA_EXPERT_SLOT_DEFERRED;
            L.loading.push_back(s);
            L.stats.background_experts++;
            L.stats.deferred_experts++;
            ++s;
            continue;
        }
        int32_t n = 1;
        while (!pf_drop && L.ram_expert.empty() && s + n < n_slots && policy.expert_of(s + n) == e + n && L.bank_expert[s + n] != e + n &&
               L.slot_state[s + n] == LLAMA_EXPERT_SLOT_READY && is_fetch(e + n) == fg) {
            ++n;
        }
        runs.push_back({ s, e, n, fg });
        s += n;
    }
    if (runs.empty()) {
        if (!L.ram_expert.empty()) {
            fill_ram(L, il, policy, *copier_sync, pack.get());
        }
        return;
    }

    // fetches first, then one wait for all of them (with a copier: one synchronisation per step instead of one
    // per copy); background admissions after them, waited for at the layer's next step
    bool fetched_async = false;
    bool background    = false;
    for (int pass = 0; pass < 2; ++pass) {
        const bool fg = pass == 0;
        for (const auto & r : runs) {
            if (r.fg != fg) {
                continue;
            }
            if (!fg && pf_drop) {
                // a droppable prefetch read: LOADING until settle_prefetch at the layer's next step
                llama_expert_engine_layer::prefetch_read p;
                p.slot       = r.s;
                p.expert     = r.e;
                p.ram_slot   = L.ram_expert.empty() ? -1 : policy.ram_slot_of(r.e);
                p.ram_before = p.ram_slot >= 0 ? L.ram_expert[p.ram_slot] : -1;
                const uint64_t copies0 = L.stats.copies, bytes0 = L.stats.copy_bytes;
                copy_run(L, il, policy, r.s, r.e, 1, *L.copier, false, pack.get(), /*prefetch =*/ true);
                p.copies = L.stats.copies - copies0;
                p.bytes  = L.stats.copy_bytes - bytes0;
                L.slot_state[r.s] = LLAMA_EXPERT_SLOT_LOADING;
                L.prefetching.push_back(p);
                L.stats.background_experts++;
                continue;
            }
            // the synchronous copier (CPU builds by default): an admission still goes through the LOADING state until
            // the layer's next route step
            copy_run(L, il, policy, r.s, r.e, r.n, *L.copier, fg, pack.get());
            for (int32_t i = 0; i < r.n; ++i) {
                L.slot_state[r.s + i] = fg ? LLAMA_EXPERT_SLOT_READY : LLAMA_EXPERT_SLOT_LOADING;
                if (!fg) {
                    L.loading.push_back(r.s + i);
                }
            }
            if (fg) {
                fetched_async = L.copier->async();
            } else {
                L.stats.background_experts += r.n;
                background = true;
            }
        }
        if (fg && fetched_async) {
            L.copier->record(mark_fetch(il));
        }
    }
    if (!L.ram_expert.empty()) {
        const bool async = L.copier->async() && fetched != nullptr;
        fill_ram(L, il, policy, async ? *L.copier : *copier_sync, pack.get());
        L.ram_pending = L.ram_pending || async;
        background = background || async;
    }
    if (background) {
        L.copier->record(mark_bg(il)); // nothing to record for the synchronous copier
    }
    if (fetched_async) {
        const auto t_wait = std::chrono::steady_clock::now();
        L.copier->wait(mark_fetch(il)); // the ubatch computes with the fetched experts
        L.stats.fetch_wait_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - t_wait).count();
    }
    L.stats.copy_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t_start).count();
}

void llama_expert_engine::complete(int32_t il, const llama_expert_layer_policy & policy) {
    auto & L = layers[il];
    if (L.loading.empty() && !L.ram_pending) {
        return;
    }
    const auto t_start = std::chrono::steady_clock::now();
    L.copier->wait(mark_bg(il)); // returns at once for the synchronous copier
    L.ram_pending = false;
    const auto t_waited = std::chrono::steady_clock::now();
    L.stats.wait_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(t_waited - t_start).count();
    bool copied = false;
    for (int32_t s : L.loading) {
        if (L.slot_state[s] == LLAMA_EXPERT_SLOT_DEFERRED) {
            // the policy's residency has not changed since (no decision in between): copy it now
            const int32_t e = policy.expert_of(s);
            GGML_ASSERT(e >= 0 && L.bank_expert[s] != e);
            copy_run(L, il, policy, s, e, 1, *copier_sync, true, pack.get());
            copied = true;
        }
        GGML_ASSERT(L.slot_state[s] != LLAMA_EXPERT_SLOT_READY);
        L.slot_state[s] = LLAMA_EXPERT_SLOT_READY;
    }
    L.loading.clear();
    if (copied) {
        L.stats.copy_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - t_waited).count();
    }
}

void llama_expert_engine::settle_prefetch(int32_t il, llama_expert_layer_policy & policy, const int32_t * fetched,
                                          int32_t n_fetched) {
    auto & L = layers[il];
    if (L.prefetching.empty()) {
        return;
    }
    auto used = [&](int32_t e) {
        return fetched == nullptr || std::find(fetched, fetched + n_fetched, e) != fetched + n_fetched;
    };
    bool started = false;
    // from the back of the copier's queue (it starts them from the front): none starts after its turn here
    for (auto it = L.prefetching.rbegin(); it != L.prefetching.rend(); ++it) {
        const auto & p = *it;
        if (!L.copier->cancel_prefetch(mark_prefetch(il), p.slot)) {
            started = true; // running or completed: waited for below
            continue;
        }
        // not started: the slot (and the RAM-tier slot) still hold what they held; the copy never happened
        L.bank_expert[p.slot] = -1; // (its old bytes are not tracked: an empty slot to the engine)
        L.slot_state[p.slot]  = LLAMA_EXPERT_SLOT_READY;
        if (p.ram_slot >= 0) {
            L.ram_expert[p.ram_slot] = p.ram_before;
        }
        L.stats.copied_experts--;
        L.stats.copies     -= p.copies;
        L.stats.copy_bytes -= p.bytes;
        L.stats.background_experts--;
        L.stats.prefetch_cancelled++;
        if (policy.expert_of(p.slot) != p.expert) {
            continue; // evicted while the layer decided (prefetch_wasted): sync copies the slot's new expert
        }
        if (used(p.expert)) {
            if (fetched != nullptr) {
                L.stats.prefetch_late++; // read by sync, a fetch: the ubatch computes with it
            }
        } else {
            // dropped: the slot empty in the policy too (were it not droppable, sync would read it as an admission)
            policy.drop_prefetched(p.expert);
        }
    }
    if (started) {
        const auto t0 = std::chrono::steady_clock::now();
        L.copier->wait(mark_prefetch(il)); // the one prefetch read in flight (the copier starts one at a time)
        L.stats.prefetch_waits++;
        L.stats.prefetch_wait_ns += (uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - t0).count();
    }
    for (const auto & p : L.prefetching) {
        L.slot_state[p.slot] = LLAMA_EXPERT_SLOT_READY;
    }
    L.prefetching.clear();
}

int32_t llama_expert_engine::slot_for(int32_t il, const llama_expert_layer_policy & policy, int32_t expert) const {
    const int32_t slot = policy.slot_of(expert);
    // an expert computed with by the current token is resident and its copy has completed: the policy
    // never evicts an expert in use by the token being decided
    GGML_ASSERT(slot >= 0 && slot < n_slots && "expert cache engine: an expert in use is not resident");
    GGML_ASSERT(layers[il].bank_expert[slot] == expert && layers[il].slot_state[slot] == LLAMA_EXPERT_SLOT_READY &&
                "expert cache engine: slot used before its copy completed");
    return slot;
}

bool llama_expert_engine::failed() const {
    if (llama_expert_copy_failed()) {
        return true;
    }
    for (const auto & [path, f] : files) {
        if (f->failed.load(std::memory_order_relaxed)) {
            return true;
        }
    }
    return pack && pack->file->failed.load(std::memory_order_relaxed);
}

bool llama_expert_engine::check_files() {
    bool ok = true;
    for (auto & [path, f] : files) {
        ok = llama_expert_file_check(*f) && ok;
    }
    if (pack) {
        ok = llama_expert_file_check(*pack->file) && ok;
    }
    return ok;
}

std::string llama_expert_engine::failure() const {
    if (llama_expert_copy_failed()) {
        return llama_expert_copy_failure();
    }
    for (const auto & [path, f] : files) {
        if (f->failed.load()) {
            std::lock_guard<std::mutex> lock(f->error_mtx);
            return f->error;
        }
    }
    if (pack && pack->file->failed.load()) {
        std::lock_guard<std::mutex> lock(pack->file->error_mtx);
        return pack->file->error;
    }
    return "";
}

void llama_expert_engine::reset_stats() {
    for (auto & L : layers) {
        L.stats = {};
    }
    for (auto & [path, f] : files) {
        f->reads = 0;
        f->bytes = 0;
        f->ns    = 0;
    }
    if (pack) {
        pack->file->reads = 0;
        pack->file->bytes = 0;
        pack->file->ns    = 0;
    }
}

uint64_t llama_expert_engine::expert_bytes(int32_t il) const {
    uint64_t n = 0;
    for (const auto & b : layers[il].banks) {
        n += b.stride;
    }
    return n;
}

llama_expert_engine_stats llama_expert_engine::total() const {
    llama_expert_engine_stats t;
    for (const auto & L : layers) {
        t.add(L.stats);
    }
    // host=file: the reads, counted by the threads that made them
    for (const auto & [path, f] : files) {
        t.file_reads      += f->reads.load();
        t.file_read_bytes += f->bytes.load();
        t.file_read_ns    += f->ns.load();
    }
    if (pack) { // the pack's reads count as reads of the model file's experts too
        t.pack_reads       = pack->file->reads.load();
        t.pack_read_bytes  = pack->file->bytes.load();
        t.file_reads      += t.pack_reads;
        t.file_read_bytes += t.pack_read_bytes;
        t.file_read_ns    += pack->file->ns.load();
    }
    return t;
}

size_t llama_expert_engine::total_size() const {
    size_t size = 0;
    for (const auto & bs : sizes) {
        size += bs.second;
    }
    return size;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_expert_engine::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> ret;
    for (const auto & [buft, size] : sizes) {
        ret[buft] += size;
    }
    return ret;
}
