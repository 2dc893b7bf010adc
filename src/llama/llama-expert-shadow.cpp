#include "llama-expert-shadow.h"

#include "llama-batch.h"

#include <algorithm>
#include <chrono>
#include <cmath>

// log-softmax of one row in place; prob (when not null): the probabilities too (one pass of exp for both)
static void shadow_log_softmax(float * x, int64_t n, float * prob = nullptr) {
    float mx = x[0];
    for (int64_t i = 1; i < n; ++i) {
        mx = std::max(mx, x[i]);
    }
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const float e = std::exp(x[i] - mx);
        s += e;
        if (prob) {
            prob[i] = e;
        }
    }
    const float lse = mx + (float) std::log(s);
    for (int64_t i = 0; i < n; ++i) {
        x[i] -= lse;
    }
    if (prob) {
        const float inv = (float) (1.0 / s);
        for (int64_t i = 0; i < n; ++i) {
            prob[i] *= inv;
        }
    }
}

// KL(p || q) from p's probabilities and both log-probabilities, in nats
static double shadow_kl(const float * p, const float * lp, const float * lq, int64_t n) {
    double kl = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        kl += (double) p[i] * ((double) lp[i] - lq[i]);
    }
    return std::max(kl, 0.0);
}

// the two-sided 95% quantile of Student's t with df degrees of freedom (Cornish-Fisher expansion about the normal
// quantile: within 0.2% of the exact value from df = 3 on; df 1 and 2 exact)
static double shadow_t975(uint64_t df) {
    if (df == 1) {
        return 12.706;
    }
    if (df == 2) {
        return 4.303;
    }
    const double z = 1.959964, v = (double) df;
    const double z3 = z*z*z, z5 = z3*z*z, z7 = z5*z*z;
    return z + (z3 + z) / (4*v) + (5*z5 + 16*z3 + 3*z) / (96*v*v) + (3*z7 + 19*z5 + 17*z3 - 15*z) / (384*v*v*v);
}

// the mean of the per-sample means (samples without a row left out) and its 95% t interval
static llama_expert_shadow_mean shadow_mean(const std::vector<double> & sum, const std::vector<uint32_t> & n) {
    std::vector<double> m;
    for (size_t i = 0; i < sum.size(); ++i) {
        if (n[i] > 0) {
            m.push_back(sum[i] / n[i]);
        }
    }
    llama_expert_shadow_mean out;
    out.n = m.size();
    if (m.empty()) {
        return out;
    }
    double s = 0.0;
    for (double x : m) {
        s += x;
    }
    out.mean = s / m.size();
    out.low = out.high = out.mean;
    if (m.size() > 1) {
        double v = 0.0;
        for (double x : m) {
            v += (x - out.mean) * (x - out.mean);
        }
        const double se = std::sqrt(v / (m.size() - 1) / m.size());
        out.low  = out.mean - shadow_t975(m.size() - 1) * se;
        out.high = out.mean + shadow_t975(m.size() - 1) * se;
    }
    return out;
}

void llama_expert_shadow::resolve_pending(const llama_ubatch & ubatch) {
    std::lock_guard<std::mutex> lock(mtx);
    if (!pending) {
        return;
    }
    pending = false;
    if (ubatch.n_tokens == 0 || ubatch.token == nullptr || ubatch.seq_id == nullptr || ubatch.pos == nullptr) {
        return;
    }
    if (ubatch.seq_id[0][0] != pending_seq || ubatch.pos[0] != pending_pos + 1) {
        return; // another sequence, or not the next position: the next token is not known
    }
    const llama_token next = ubatch.token[0];
    if (next < 0 || (size_t) next >= pending_exact.size()) {
        return;
    }
    dnll_sum[pending_sample] += (double) pending_exact[next] - pending_served[next];
    dnll_n[pending_sample]++;
}

void llama_expert_shadow::compare(const llama_ubatch & ubatch, int64_t n_vocab, int64_t n_rows) {
    std::lock_guard<std::mutex> lock(mtx);
    const size_t s = kl_sum.size();
    kl_sum.push_back(0.0);
    kl_n.push_back(0);
    dnll_sum.push_back(0.0);
    dnll_n.push_back(0);
    int64_t row = 0;
    for (uint32_t i = 0; i < ubatch.n_tokens && row < n_rows; ++i) {
        if (ubatch.output && !ubatch.output[i]) {
            continue;
        }
        float * le = exact.data()  + row*n_vocab;
        float * ls = served.data() + row*n_vocab;
        prob.resize((size_t) n_vocab);
        shadow_log_softmax(le, n_vocab, prob.data());
        shadow_log_softmax(ls, n_vocab);
        kl_sum[s] += shadow_kl(prob.data(), le, ls, n_vocab);
        kl_n[s]++;
        ++row;
        if (ubatch.token == nullptr || ubatch.seq_id == nullptr || ubatch.pos == nullptr) {
            continue;
        }
        if (i + 1 < ubatch.n_tokens) {
            const llama_token next = ubatch.token[i + 1];
            if (ubatch.seq_id[i + 1][0] == ubatch.seq_id[i][0] && ubatch.pos[i + 1] == ubatch.pos[i] + 1 &&
                    next >= 0 && next < n_vocab) {
                dnll_sum[s] += (double) le[next] - ls[next];
                dnll_n[s]++;
            }
        } else {
            // the next token comes with the next ubatch
            pending        = true;
            pending_sample = s;
            pending_seq    = ubatch.seq_id[i][0];
            pending_pos    = ubatch.pos[i];
            pending_exact.assign(le, le + n_vocab);
            pending_served.assign(ls, ls + n_vocab);
        }
    }
}

ggml_status llama_expert_shadow::compute_ubatch(const llama_ubatch & ubatch, ggml_tensor * t_logits,
        ggml_backend_sched_t sched, const std::function<ggml_status(bool again)> & compute) {
    resolve_pending(ubatch);
    bool outputs = ubatch.output == nullptr && ubatch.n_tokens > 0;
    for (uint32_t i = 0; ubatch.output && i < ubatch.n_tokens && !outputs; ++i) {
        outputs = ubatch.output[i] != 0;
    }
    // the ubatches with an output count (llama-perplexity asks none of a chunk's first half)
    const bool due = every > 0 && t_logits != nullptr && outputs && (seen++ % every) == every - 1;
    if (!due) {
        return compute(false);
    }
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t n_vocab = t_logits->ne[0];
    const int64_t n_rows  = ggml_nrows(t_logits);
    const size_t  n       = (size_t) (n_vocab * n_rows);

    saved.resize(state.size());
    for (size_t i = 0; i < state.size(); ++i) {
        saved[i].resize(ggml_nbytes(state[i]));
        ggml_backend_tensor_get(state[i], saved[i].data(), 0, saved[i].size());
    }
    active = true;
    ggml_status st = compute(false);
    active = false;
    if (st != GGML_STATUS_SUCCESS) {
        return st;
    }
    ggml_backend_sched_synchronize(sched);
    exact.resize(n);
    ggml_backend_tensor_get(t_logits, exact.data(), 0, n * sizeof(float));
    for (size_t i = 0; i < state.size(); ++i) {
        ggml_backend_tensor_set(state[i], saved[i].data(), 0, saved[i].size()); // the state before the exact pass
    }
    const auto t1 = std::chrono::steady_clock::now();

    st = compute(true); // served (its inputs set again): its memory writes and logits are what the caller keeps
    if (st != GGML_STATUS_SUCCESS) {
        return st;
    }
    const auto t2 = std::chrono::steady_clock::now();
    ggml_backend_sched_synchronize(sched);
    served.resize(n);
    ggml_backend_tensor_get(t_logits, served.data(), 0, n * sizeof(float));
    compare(ubatch, n_vocab, n_rows);
    const auto t3 = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mtx);
    shadow_ns += std::chrono::duration<double, std::nano>((t1 - t0) + (t3 - t2)).count();
    return st;
}

llama_expert_shadow_summary llama_expert_shadow::summary() const {
    std::lock_guard<std::mutex> lock(mtx);
    llama_expert_shadow_summary out;
    out.every    = every;
    out.ubatches = kl_sum.size();
    for (size_t i = 0; i < kl_n.size(); ++i) {
        out.rows  += kl_n[i];
        out.pairs += dnll_n[i];
    }
    out.kl   = shadow_mean(kl_sum, kl_n);
    out.dnll = shadow_mean(dnll_sum, dnll_n);
    out.dppl_pct      = 100.0 * std::expm1(out.dnll.mean);
    out.dppl_pct_low  = 100.0 * std::expm1(out.dnll.low);
    out.dppl_pct_high = 100.0 * std::expm1(out.dnll.high);
    out.shadow_ms     = 1e-6 * shadow_ns;
    return out;
}

void llama_expert_shadow::reset() {
    std::lock_guard<std::mutex> lock(mtx);
    seen = 0;
    kl_sum.clear();
    kl_n.clear();
    dnll_sum.clear();
    dnll_n.clear();
    shadow_ns = 0.0;
    pending = false;
}
