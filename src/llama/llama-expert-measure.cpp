#include "llama-expert-measure.h"

#include "llama-expert-budget.h"
#include "llama-expert-io.h"
#include "llama-expert-machine.h"

#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

ggml_backend_dev_t llama_expert_layer_dev(const llama_model & model, int il) {
    try {
        return model.dev_layer(il);
    } catch (const std::out_of_range &) {
        return model.dev_output();
    }
}

std::string llama_expert_remote_dev(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    if (reg == nullptr || strcmp(ggml_backend_reg_name(reg), "RPC") != 0) {
        return "";
    }
    return std::string(ggml_backend_dev_name(dev)) + " (" + ggml_backend_dev_description(dev) + ")";
}

int llama_expert_dim(const ggml_tensor * t) {
    for (int d = GGML_MAX_DIMS - 1; d > 0; --d) {
        if (t->ne[d] > 1) {
            return d;
        }
    }
    return 0;
}

std::array<ggml_tensor *, LLAMA_EXPERT_N_TENSORS> llama_expert_layer_tensors(const llama_layer & ml) {
    return {
        ml.ffn_up_exps, ml.ffn_gate_exps, ml.ffn_down_exps, ml.ffn_gate_up_exps,
        ml.ffn_up_exps_b, ml.ffn_gate_exps_b, ml.ffn_down_exps_b, ml.ffn_gate_up_exps_b,
        ml.ffn_up_exps_s, ml.ffn_gate_exps_s, ml.ffn_down_exps_s,
    };
}

int32_t llama_expert_engine_slots_for_budget(const llama_model & model, const std::vector<bool> & moe,
        int32_t n_expert, int32_t k, uint64_t budget, uint64_t reserve,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem, const std::string & prefix, bool ram,
        int32_t readers, bool engine, uint64_t runtime) {
    llama_expert_budget b;
    b.ram      = ram;
    b.budget   = budget;
    b.reserve  = reserve;
    b.n_expert = n_expert;
    b.k        = k;
    std::map<ggml_backend_buffer_type_t, bool> bufts;
    uint64_t expert_bytes = 0; // all routed-expert tensors (ram=: they stay in the file, not in the budget)
    uint64_t max_slice    = 0; // the largest expert slice of any bank: one read
    bool     host_banks   = true;
    for (size_t il = 0; il < moe.size(); ++il) {
        if (!moe[il]) {
            continue;
        }
        ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(llama_expert_layer_dev(model, (int) il));
        bufts[buft] = true;
        host_banks = host_banks && ggml_backend_buft_is_host(buft);
        for (const ggml_tensor * t : llama_expert_layer_tensors(model.layers[il])) {
            if (t) {
                b.per_slot += t->nb[llama_expert_dim(t)];
                b.n_banks++;
                expert_bytes += ggml_nbytes(t);
                max_slice = std::max<uint64_t>(max_slice, t->nb[llama_expert_dim(t)]);
            }
        }
    }
    if (ram) {
        // the process's own memory besides weights, context and banks: each reader thread and the calling thread
        // keep an aligned buffer of one slice and two 4 KiB blocks (llama-expert-io.cpp, O_DIRECT); the runtime
        b.readers  = readers > 0 ? (uint64_t) (readers + 1) * (max_slice + 2*4096) : 0;
        b.baseline = runtime > 0 ? runtime : LLAMA_EXPERT_RUNTIME_BASELINE;
    }
    for (const auto & [buft, size] : model.memory_breakdown()) {
        if (ram || bufts.count(buft)) {
            b.weights += size;
        }
    }
    for (const auto & [buft, size] : ctx_mem) {
        if (ram || bufts.count(buft)) {
            b.context += size;
        }
    }
    if (ram) {
        // ram=: the whole process's weights less the routed experts (read from the file with host=file)
        b.weights = b.weights > expert_bytes ? b.weights - expert_bytes : 0;
    }
    std::string err;
    const int32_t n_slots = llama_expert_budget_slots(b, err);
    if (n_slots < 0) {
        throw std::runtime_error(prefix + err);
    }
    // what the process may really hold (memory cgroup, MemAvailable): a plan above it is one line, not an OOM kill;
    // vram= is checked where its banks are host memory (CPU builds); a GPU's own memory is not read here. Emulate
    // mode allocates no banks (its budget may describe another machine): not checked
    if (engine && (ram || host_banks) && !model.hparams.no_alloc) {
        const llama_expert_machine m = llama_expert_machine_current();
        if (!llama_expert_budget_check_usable(b, n_slots, m.usable(), m.describe(), err)) {
            throw std::runtime_error(prefix + err);
        }
    }
    // the same arithmetic in exact bytes, for the harness (harness plan: one formula on both sides, tested)
    LLAMA_LOG_INFO("%s: %s\n", __func__, llama_expert_budget_plan_line(b, n_slots).c_str());
    LLAMA_LOG_INFO("%s: %s\n", __func__, llama_expert_budget_summary(b, n_slots).c_str());
    return n_slots;
}

llama_expert_auto_model llama_expert_engine_auto_facts(const llama_model & model,
        const std::map<ggml_backend_buffer_type_t, size_t> & ctx_mem) {
    llama_expert_auto_model m;
    m.n_expert = (int32_t) model.hparams.n_expert;
    m.k        = (int32_t) model.hparams.n_expert_used_max();
    m.n_vocab  = (uint64_t) model.vocab.n_tokens();
    m.n_embd   = model.hparams.n_embd;
    std::map<ggml_backend_buffer_type_t, bool> dev_bufts; // the buffer types of the GPU that holds the MoE layers
    ggml_backend_dev_t gpu = nullptr;
    for (size_t il = 0; il < model.layers.size(); ++il) {
        const llama_layer & L = model.layers[il];
        if (L.ffn_down_exps == nullptr && L.ffn_gate_up_exps == nullptr) {
            continue;
        }
        if (il < model.hparams.n_layer_all) {
            m.n_ff_exp = std::max<uint64_t>(m.n_ff_exp, model.hparams.n_ff_exp((uint32_t) il));
        }
        ggml_backend_dev_t dev = llama_expert_layer_dev(model, (int) il);
        if (m.remote.empty()) {
            m.remote = llama_expert_remote_dev(dev);
        }
        if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            m.gpu = true;
            gpu = gpu ? gpu : dev;
            dev_bufts[ggml_backend_dev_buffer_type(dev)] = true;
        }
        for (const ggml_tensor * t : llama_expert_layer_tensors(L)) {
            if (t == nullptr) {
                continue;
            }
            m.per_slot += t->nb[llama_expert_dim(t)];
            m.n_banks++;
            m.experts  += ggml_nbytes(t);
            m.max_slice = std::max<uint64_t>(m.max_slice, t->nb[llama_expert_dim(t)]);
            if (t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer)) {
                m.experts_host = false;
            }
            if (t->buffer && strstr(ggml_backend_buffer_name(t->buffer), "REPACK") != nullptr) {
                m.repacked = true;
            }
            std::string path;
            uint64_t off = 0;
            if (!model.hparams.no_alloc && t->data && !llama_expert_mapped_file_of(t->data, path, off)) {
                m.mapped = false; // (a memory-fitting dry run maps nothing: not known there)
            }
        }
    }
    uint64_t all = 0;
    for (const auto & [buft, size] : model.memory_breakdown()) {
        all += size;
        if (dev_bufts.count(buft)) {
            m.dev_weights += size;
        }
    }
    m.weights = all > m.experts ? all - m.experts : 0;
    if (!m.experts_host) {
        m.dev_weights = m.dev_weights > m.experts ? m.dev_weights - m.experts : 0;
    }
    for (const auto & [buft, size] : ctx_mem) {
        m.context += size;
        if (dev_bufts.count(buft)) {
            m.dev_context += size;
        }
    }
    if (gpu) {
        size_t free = 0;
        size_t total = 0;
        ggml_backend_dev_memory(gpu, &free, &total);
        m.dev_free = free;
    }
    return m;
}

std::vector<std::pair<uintptr_t, uintptr_t>> llama_expert_mapped_weight_ranges(const llama_model & model) {
    std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
    for (const auto & [name, t] : model.tensors_by_name) {
        std::string path;
        uint64_t off = 0;
        if (t == nullptr || t->data == nullptr || t->buffer == nullptr || !ggml_backend_buffer_is_host(t->buffer) ||
                !llama_expert_mapped_file_of(t->data, path, off)) {
            continue;
        }
        ranges.emplace_back((uintptr_t) t->data, (uintptr_t) t->data + ggml_nbytes(t));
    }
    return ranges;
}
