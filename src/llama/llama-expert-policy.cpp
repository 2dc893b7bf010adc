#include "llama-expert-policy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>


//
// statistics
//

void llama_expert_policy_stats::add(const llama_expert_policy_stats & o) {
#define LLAMA_EXPERT_COUNTER_ADD(field, metric, help) field += o.field;
    LLAMA_EXPERT_POLICY_COUNTERS(LLAMA_EXPERT_COUNTER_ADD)
#undef LLAMA_EXPERT_COUNTER_ADD
    subst_mass_sum          += o.subst_mass_sum;
    drop_mass_sum           += o.drop_mass_sum;
    max_subst_weight         = std::max(max_subst_weight, o.max_subst_weight);
    for (int i = 0; i < LLAMA_EXPERT_MASS_HIST_BINS; ++i) {
        mass_hist[i] += o.mass_hist[i];
    }
}

//
// layer policy
//

void llama_expert_layer_policy::init(int32_t n_expert_, int32_t n_slots_, const llama_expert_cache_config & cfg) {
    n_expert  = n_expert_;
    n_slots   = std::min(n_slots_, n_expert_);
    par       = llama_expert_cache_config_params(cfg);
    rule_row  = &llama_expert_rule_of(cfg.rule);
    n_ram     = std::min(llama_expert_cache_config_n_ram_slots(cfg, n_expert_), n_expert_);

    initial.resize(n_slots);
    for (int32_t s = 0; s < n_slots; ++s) {
        initial[s] = s;
    }
    reset();
}

void llama_expert_layer_policy::set_initial(const std::vector<uint64_t> * counts) {
    std::vector<int32_t> order(n_expert);
    for (int32_t e = 0; e < n_expert; ++e) {
        order[e] = e;
    }
    if (counts && (int32_t) counts->size() == n_expert) {
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return (*counts)[a] > (*counts)[b];
        });
    }
    initial.assign(order.begin(), order.begin() + n_slots);
    reset();
}

void llama_expert_layer_policy::reset() {
    slot_by_expert.assign(n_expert, -1);
    expert_by_slot.assign(n_slots, -1);
    use_count.assign(n_expert, 0);
    last_use.assign(n_expert, 0);
    admit_acc.assign(n_expert, 0.0);
    sel_total.assign(n_expert, 0);
    decay_count.assign(n_expert, 0.0);
    decay_tick.assign(n_expert, 0);
    sel_mark.assign(n_expert, 0);
    sub_mark.assign(n_expert, 0);
    hold_mark.assign(n_expert, 0);
    group    = 0;
    in_group = false;
    cand.clear();
    cand_tick = 0;
    window.clear();
    window_tick = 0;
    pending.clear();
    pf_unused.assign(n_expert, 0);
    pf_mark.assign(n_expert, 0);
    pf_tick     = 0;
    in_prefetch = false;
    tick  = 0;
    stats = llama_expert_policy_stats();
    ram_slot_by_expert.assign(n_ram > 0 ? n_expert : 0, -1);
    expert_by_ram_slot.assign(n_ram, -1);
    ram_last.assign(n_ram > 0 ? n_expert : 0, 0);
    for (int32_t s = 0; s < (int32_t) initial.size(); ++s) {
        place(initial[s], s);
        if (s < n_ram) { // the RAM tier holds the initial residency too (it is filled from the file through it)
            expert_by_ram_slot[s]         = initial[s];
            ram_slot_by_expert[initial[s]]    = s;
        }
    }
}

void llama_expert_layer_policy::ram_touch(int32_t e) {
    if (n_ram > 0 && ram_slot_by_expert[e] >= 0) {
        ram_last[e] = tick;
    }
}

void llama_expert_layer_policy::ram_load(int32_t e) {
    if (n_ram == 0) {
        return;
    }
    if (ram_slot_by_expert[e] >= 0) {
        stats.ram_tier_loads++;
        ram_last[e] = tick;
        return;
    }
    stats.file_loads++;
    // into the RAM tier on its way: a free RAM slot, else the least recently used expert not used or loaded by
    // this token (ties: lowest id); none (every RAM slot used by this token): the expert is not kept in RAM
    int32_t slot = -1, victim = -1;
    for (int32_t s = 0; s < n_ram; ++s) {
        const int32_t x = expert_by_ram_slot[s];
        if (x < 0) {
            slot = s;
            break;
        }
        if (ram_last[x] == tick || sel_mark[x] == tick || sub_mark[x] == tick || (in_group && hold_mark[x] == group)) {
            continue;
        }
        if (victim < 0 || ram_last[x] < ram_last[victim] || (ram_last[x] == ram_last[victim] && x < victim)) {
            victim = x;
        }
    }
    if (slot < 0 && victim >= 0) {
        slot = ram_slot_by_expert[victim];
        ram_slot_by_expert[victim] = -1;
    }
    if (slot >= 0) {
        expert_by_ram_slot[slot] = e;
        ram_slot_by_expert[e]        = slot;
        ram_last[e]      = tick;
    }
}

int32_t llama_expert_layer_policy::n_resident() const {
    int32_t n = 0;
    for (int32_t e : expert_by_slot) {
        n += e >= 0;
    }
    return n;
}

void llama_expert_layer_policy::place(int32_t e, int32_t slot) {
    const int32_t old = expert_by_slot[slot];
    if (old >= 0) {
        slot_by_expert[old] = -1;
        if (pf_unused[old]) {
            pf_unused[old] = 0;
            stats.prefetch_wasted++;
        }
    }
    expert_by_slot[slot] = e;
    slot_by_expert[e]      = slot;
    admit_acc[e]    = 0.0;
    pf_unused[e]    = 0;
}

bool llama_expert_layer_policy::busy(int32_t e) const {
    if (in_group && hold_mark[e] == group) {
        return true; // computed with by a token of the current group
    }
    if (in_prefetch) {
        return pf_mark[e] == pf_tick; // another expert of the prediction being applied (between two tokens)
    }
    return sel_mark[e] == tick || sub_mark[e] == tick; // selected by, or a substitute of, the token being decided
}

int32_t llama_expert_layer_policy::prefetch_experts(const int32_t * ids, int32_t n) {
    ++pf_tick;
    for (int32_t r = 0; r < n; ++r) {
        if (ids[r] >= 0 && ids[r] < n_expert) {
            pf_mark[ids[r]] = pf_tick;
        }
    }
    in_prefetch = true;
    int32_t added = 0;
    const int32_t budget = par.prefetch_max > 0 ? par.prefetch_max : n;
    for (int32_t r = 0; r < n && added < budget; ++r) {
        const int32_t e = ids[r];
        if (e < 0 || e >= n_expert || slot_by_expert[e] >= 0) {
            continue;
        }
        const int32_t slot = find_slot();
        if (slot < 0) {
            break; // every slot is held by the group or by this prediction
        }
        place(e, slot);
        ram_load(e);
        last_use[e]  = tick;
        pf_unused[e] = 1;
        stats.prefetches++;
        ++added;
    }
    in_prefetch = false;
    return added;
}

bool llama_expert_layer_policy::drop_prefetched(int32_t e) {
    if (e < 0 || e >= n_expert || slot_by_expert[e] < 0 || !pf_unused[e]) {
        return false;
    }
    expert_by_slot[slot_by_expert[e]] = -1;
    slot_by_expert[e] = -1;
    pf_unused[e]      = 0;
    if (n_ram > 0 && ram_slot_by_expert[e] >= 0) {
        expert_by_ram_slot[ram_slot_by_expert[e]] = -1;
        ram_slot_by_expert[e] = -1;
    }
    stats.prefetch_dropped++;
    return true;
}

double llama_expert_layer_policy::classlru_count(int32_t e) const {
    // exact exponential decay, applied lazily: the count as of decay_tick, halved every half_life ticks since
    return decay_count[e] * std::exp2(-(double) (tick - decay_tick[e]) / (double) par.classlru_half_life);
}

int32_t llama_expert_layer_policy::classlru_class(int32_t e) const {
    const double c = classlru_count(e);
    if (!(c >= 2.0)) {
        return 0; // floor(log2(c)) <= 0
    }
    int ex = 0;
    std::frexp(c, &ex); // c = f * 2^ex, f in [0.5, 1): floor(log2(c)) = ex - 1, exactly
    return std::min<int32_t>(ex - 1, (int32_t) par.classlru_classes - 1);
}

void llama_expert_layer_policy::count_use(int32_t e, double n) {
    if (n == 0.0) {
        return;
    }
    use_count[e] += (uint32_t) n;
    if (par.evict == LLAMA_EXPERT_EVICT_CLASSLRU) {
        decay_count[e] = classlru_count(e) + n;
        decay_tick[e]  = tick;
    }
}

int32_t llama_expert_layer_policy::find_slot() {
    int32_t best    = -1;
    int32_t best_e  = -1;
    if (par.evict == LLAMA_EXPERT_EVICT_CLASSLRU) {
        // ClassLRU: the least recently used evictable expert of each class (ties: lowest id), then among those
        // the largest age / 2^class (ties: the lower class)
        int32_t head[32];
        std::fill(head, head + 32, -1);
        for (int32_t s = 0; s < n_slots; ++s) {
            const int32_t e = expert_by_slot[s];
            if (e < 0) {
                return s;
            }
            if (busy(e)) {
                continue;
            }
            const int32_t c = classlru_class(e);
            const int32_t h = head[c];
            if (h < 0 || last_use[e] < last_use[h] || (last_use[e] == last_use[h] && e < h)) {
                head[c] = e;
            }
        }
        double best_key = -1.0;
        for (int32_t c = 0; c < (int32_t) par.classlru_classes; ++c) {
            const int32_t e = head[c];
            if (e < 0) {
                continue;
            }
            const double key = std::ldexp((double) (tick - last_use[e]), -c);
            if (key > best_key) {
                best_key = key;
                best_e   = e;
            }
        }
        if (best_e < 0) {
            return -1;
        }
        stats.evictions++;
        return slot_by_expert[best_e];
    }
    for (int32_t s = 0; s < n_slots; ++s) {
        const int32_t e = expert_by_slot[s];
        if (e < 0) {
            return s;
        }
        // never evict an expert used by the token being decided, or by an earlier token of the group
        if (busy(e)) {
            continue;
        }
        if (best < 0) {
            best = s; best_e = e;
            continue;
        }
        bool better;
        if (par.evict == LLAMA_EXPERT_EVICT_LFU) {
            // least frequently used; ties: least recently used, then lowest id
            better = use_count[e] < use_count[best_e] ||
                (use_count[e] == use_count[best_e] && (last_use[e] < last_use[best_e] ||
                    (last_use[e] == last_use[best_e] && e < best_e)));
        } else {
            // least recently used; ties: lowest id
            better = last_use[e] < last_use[best_e] || (last_use[e] == last_use[best_e] && e < best_e);
        }
        if (better) {
            best = s; best_e = e;
        }
    }
    if (best >= 0) {
        stats.evictions++;
    }
    return best;
}

int32_t llama_expert_layer_policy::find_substitute(const float * scores, bool allow_reuse) {
    // Fast path: on the first substitution of a token, keep the best-scored resident experts that the token
    // did not select, in order (score descending, then id ascending). Within the token no expert joins that
    // set (a fetch loads a selected expert; admissions happen at the end of the token), experts only leave it
    // (evicted, or used as a substitute), so the first one still valid is the argmax of the full scan below.
    // When none of them is valid any more, fall back to the full scan.
    const auto better = [scores](int32_t a, int32_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    };
    if (!allow_reuse && fast_substitute) {
        if (cand_tick != tick) {
            // insertion into a short sorted array of (score, id); most experts fail the first comparison
            const int32_t cap = 8;
            float   cs[cap];
            int32_t ce[cap];
            int32_t n = 0;
            for (int32_t s = 0; s < n_slots; ++s) {
                const int32_t e = expert_by_slot[s];
                if (e < 0 || sel_mark[e] == tick) {
                    continue;
                }
                const float v = scores[e];
                if (n == cap && !(v > cs[cap - 1] || (v == cs[cap - 1] && e < ce[cap - 1]))) {
                    continue;
                }
                int32_t i = n < cap ? n++ : cap - 1;
                while (i > 0 && (v > cs[i - 1] || (v == cs[i - 1] && e < ce[i - 1]))) {
                    cs[i] = cs[i - 1];
                    ce[i] = ce[i - 1];
                    --i;
                }
                cs[i] = v;
                ce[i] = e;
            }
            cand.assign(ce, ce + n);
            cand_tick = tick;
        }
        for (int32_t e : cand) {
            if (slot_by_expert[e] >= 0 && sub_mark[e] != tick) {
                return e;
            }
        }
    }

    int32_t best = -1;
    for (int32_t s = 0; s < n_slots; ++s) {
        const int32_t e = expert_by_slot[s];
        if (e < 0 || sel_mark[e] == tick || (!allow_reuse && sub_mark[e] == tick)) {
            continue;
        }
        if (best < 0 || better(e, best)) {
            best = e;
        }
    }
    return best;
}

int32_t llama_expert_layer_policy::find_route_substitute(const float * scores, int32_t k) {
    // the router's top m of this token (score descending, ties: lowest id), built on the first need
    if (window_tick != tick) {
        const int32_t m = std::min(n_expert, par.route_m > 0 ? par.route_m : 2*k);
        window.resize(n_expert);
        for (int32_t e = 0; e < n_expert; ++e) {
            window[e] = e;
        }
        std::partial_sort(window.begin(), window.begin() + m, window.end(), [scores](int32_t a, int32_t b) {
            return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
        });
        window.resize(m);
        window_tick = tick;
    }
    // the best of them that is resident, not selected by the token and not yet one of its substitutes
    for (int32_t e : window) {
        if (slot_by_expert[e] >= 0 && sel_mark[e] != tick && sub_mark[e] != tick) {
            return e;
        }
    }
    return -1;
}

void llama_expert_layer_policy::begin_group() {
    ++group;
    in_group = true;
}

void llama_expert_layer_policy::end_group() {
    in_group = false;
}

void llama_expert_layer_policy::decide(const int32_t * ids, const float * w, int32_t k, const float * scores,
                                       int32_t * out_ids, uint8_t * out_actions, float * out_scale) {
    const llama_expert_rule & R = *rule_row;
    ++tick;
    for (int32_t r = 0; r < k; ++r) {
        sel_mark[ids[r]] = tick;
    }

    double mass      = 0.0;
    double drop_mass = 0.0;

    if (R.id == LLAMA_EXPERT_MISS_BUDGET) {
        spend_budget(ids, w, k);
    }

    for (int32_t r = 0; r < k; ++r) {
        const int32_t e = ids[r];
        stats.calls++;
        count_use(e, 1.0);
        sel_total[e]++;
        if (out_scale) {
            out_scale[r] = 1.0f;
        }

        // a cache-unaware rule (SER) skips a selection before the residency is looked at
        if (R.skip && R.skip(r, w[r], w[0], par)) {
            stats.skips++;
            drop_mass     += w[r];
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_DROP;
            continue;
        }

        if (slot_by_expert[e] >= 0) {
            stats.hits++;
            if (pf_unused[e]) {
                pf_unused[e] = 0;
                stats.prefetch_used++;
            }
            last_use[e]    = tick;
            ram_touch(e);
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_HIT;
            continue;
        }

        decide_miss(r, e, w, scores, k, out_ids, out_actions, out_scale, mass, drop_mass);
    }

    apply_scales(w, k, out_actions, out_scale);
    if (in_group) {
        // the experts this token computes with stay resident until the group ends
        for (int32_t r = 0; r < k; ++r) {
            if (out_actions[r] != LLAMA_EXPERT_ACTION_DROP && out_actions[r] != LLAMA_EXPERT_ACTION_HOST) {
                hold_mark[out_ids[r]] = group;
            }
        }
    }

    admit_pending();
    count_token(mass, drop_mass);
}

// rule=budget: the token's misses from the lightest up (ties: the later rank first) are substituted while their
// summed gate weight stays within the budget; the first that would exceed it, and every heavier one, is fetched
void llama_expert_layer_policy::spend_budget(const int32_t * ids, const float * w, int32_t k) {
    budget_sub.assign(k, 0);
    budget_order.clear();
    for (int32_t r = 0; r < k; ++r) {
        if (slot_by_expert[ids[r]] < 0) {
            budget_order.push_back(r);
        }
    }
    std::stable_sort(budget_order.begin(), budget_order.end(), [&](int32_t a, int32_t b) {
        return w[a] < w[b] || (w[a] == w[b] && a > b);
    });
    double spent = 0.0;
    for (int32_t r : budget_order) {
        if (spent + w[r] > (double) par.budget_mass + 1e-6) {
            break;
        }
        spent += w[r];
        budget_sub[r] = 1;
    }
}

// a miss of selection r (expert e): the rule's verdict, then a drop, a host compute, a fetch into a free slot or a
// substitute (with its admission accumulator)
void llama_expert_layer_policy::decide_miss(int32_t r, int32_t e, const float * w, const float * scores, int32_t k,
        int32_t * out_ids, uint8_t * out_actions, float * out_scale, double & mass, double & drop_mass) {
    const llama_expert_rule & R = *rule_row;
    stats.misses++;

    // the rule's verdict on the miss (the tier: whether it would be read from the model file)
    llama_expert_verdict v = llama_expert_rule_verdict(R, r, w[r], par.host_file && !in_ram(e), par);
    if (R.id == LLAMA_EXPERT_MISS_BUDGET && budget_sub[r]) {
        v = par.light_host ? LLAMA_EXPERT_VERDICT_HOST : LLAMA_EXPERT_VERDICT_SUBSTITUTE; // within the token's budget
    }

    if (v == LLAMA_EXPERT_VERDICT_DROP) {
        stats.drops++;
        drop_mass     += w[r];
        out_ids[r]     = e;
        out_actions[r] = LLAMA_EXPERT_ACTION_DROP;
        return;
    }

    if (v == LLAMA_EXPERT_VERDICT_HOST) {
        // a light miss computed on the host with the missed expert itself: exact, the residency is unchanged
        stats.host_computes++;
        out_ids[r]     = e;
        out_actions[r] = LLAMA_EXPERT_ACTION_HOST;
        if (par.admit) {
            admit_acc[e] += w[r];
            if (admit_acc[e] >= par.beta) {
                pending.push_back(e);
            }
        }
        return;
    }

    const bool want_fetch = v == LLAMA_EXPERT_VERDICT_FETCH;
    int32_t sub = -1;
    if (!want_fetch) {
        sub = R.windowed ? find_route_substitute(scores, k) : find_substitute(scores, false);
        // no resident expert available (cache-route: none within the router's top m): fetch
    }
    if (sub < 0) {
        const int32_t slot = find_slot();
        if (slot >= 0) {
            place(e, slot);
            ram_load(e);
            stats.fetches++;
            last_use[e]    = tick;
            out_ids[r]     = e;
            out_actions[r] = LLAMA_EXPERT_ACTION_FETCH;
            return;
        }
        // every slot is in use by this token (only possible when n_slots is close to k):
        // substitute, reusing a substitute of this token if needed
        sub = find_substitute(scores, false);
        if (sub < 0) {
            sub = find_substitute(scores, true);
        }
        stats.forced_substitutions++;
    }
    if (sub < 0) {
        // only possible with n_slots < k, which the configuration refuses: drop
        stats.drops++;
        drop_mass     += w[r];
        out_ids[r]     = e;
        out_actions[r] = LLAMA_EXPERT_ACTION_DROP;
        return;
    }
    // substitute: the resident expert computes with the missed expert's gate weight (cache-route: times alpha)
    stats.substitutions++;
    if (r == 0) {
        stats.subst_first_choice++;
    }
    stats.max_subst_weight = std::max(stats.max_subst_weight, w[r]);
    mass += w[r];
    sub_mark[sub]  = tick;
    last_use[sub]  = tick;
    if (pf_unused[sub]) {
        pf_unused[sub] = 0;
        stats.prefetch_used++;
    }
    ram_touch(sub);
    out_ids[r]     = sub;
    out_actions[r] = LLAMA_EXPERT_ACTION_SUBSTITUTE;
    if (out_scale && R.windowed) {
        out_scale[r] = par.route_alpha;
    }

    if (par.admit) {
        admit_acc[e] += w[r];
        if (admit_acc[e] >= par.beta) {
            pending.push_back(e);
        }
    }
}

// the gate weights the selections compute with: 0 for a drop or a skip, renorm=on's rescale of the kept ones
void llama_expert_layer_policy::apply_scales(const float * w, int32_t k, const uint8_t * out_actions, float * out_scale) {
    // a drop or a skip computes with gate weight 0
    if (out_scale) {
        for (int32_t r = 0; r < k; ++r) {
            if (out_actions[r] == LLAMA_EXPERT_ACTION_DROP) {
                out_scale[r] = 0.0f;
            }
        }
    }

    // renorm=on: the computed selections take the weight of all k (their weights times sum / kept sum)
    if (par.renorm && out_scale) {
        double sum = 0.0, kept = 0.0;
        for (int32_t r = 0; r < k; ++r) {
            sum += w[r];
            if (out_actions[r] != LLAMA_EXPERT_ACTION_DROP) {
                kept += w[r];
            }
        }
        if (kept > 0.0 && kept < sum) {
            const float f = (float) (sum / kept);
            for (int32_t r = 0; r < k; ++r) {
                if (out_actions[r] != LLAMA_EXPERT_ACTION_DROP) {
                    out_scale[r] *= f;
                }
            }
        }
    }
}

// background admission: the experts whose accumulated substituted mass reached beta, placed where a slot is free
void llama_expert_layer_policy::admit_pending() {
    for (int32_t e : pending) {
        if (slot_by_expert[e] >= 0) {
            continue;
        }
        const int32_t slot = find_slot();
        if (slot < 0) {
            continue; // every slot in use by this token; the accumulator is kept, retried on the next substitution
        }
        place(e, slot);
        ram_load(e);
        last_use[e] = tick;
        stats.admissions++;
    }
    pending.clear();
}

// the token-layer's statistics (substituted and dropped mass, its histogram) and LFU's aging
void llama_expert_layer_policy::count_token(double mass, double drop_mass) {
    stats.token_layers++;
    if (mass > 0.0) {
        stats.token_layers_with_subst++;
    }
    stats.subst_mass_sum += mass;
    stats.drop_mass_sum  += drop_mass;
    int bin = (int) (mass * LLAMA_EXPERT_MASS_HIST_BINS);
    bin = std::max(0, std::min(bin, LLAMA_EXPERT_MASS_HIST_BINS - 1));
    stats.mass_hist[bin]++;

    // LFU aging
    if (par.evict == LLAMA_EXPERT_EVICT_LFU && par.lfu_halve > 0 && tick % par.lfu_halve == 0) {
        for (auto & c : use_count) {
            c >>= 1;
        }
    }
}

//
// profiles
//

//
// prefill bypass
//

// an invariant of the policy (the policy compiles without ggml, for its unit tests and llama-moe-sim)
static void policy_check(bool ok, const char * what) {
    if (!ok) {
        fprintf(stderr, "expert policy: invariant violated: %s\n", what);
        abort();
    }
}

void llama_expert_layer_policy::warm(const std::vector<uint32_t> & counts) {
    llama_expert_layer_policy & p = *this;
    const int32_t E = p.n_expert;
    policy_check((int32_t) counts.size() == E, "one count per expert");

    std::vector<int32_t> order(E);
    for (int32_t e = 0; e < E; ++e) {
        order[e] = e;
        p.count_use(e, (double) counts[e]);
        p.sel_total[e] += counts[e];
    }
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return counts[a] > counts[b]; });

    std::vector<bool> want(E, false);
    int32_t n_want = 0;
    for (int32_t e : order) {
        if (n_want == p.n_slots || counts[e] == 0) {
            break;
        }
        want[e] = true;
        ++n_want;
    }

    // victims: slots whose expert is not wanted, empty first, then lowest count, then least recently used
    std::vector<int32_t> victims;
    for (int32_t s = 0; s < p.n_slots; ++s) {
        const int32_t e = p.expert_by_slot[s];
        if (e < 0 || !want[e]) {
            victims.push_back(s);
        }
    }
    std::stable_sort(victims.begin(), victims.end(), [&](int32_t a, int32_t b) {
        const int32_t ea = p.expert_by_slot[a], eb = p.expert_by_slot[b];
        if ((ea < 0) != (eb < 0)) {
            return ea < 0;
        }
        if (ea < 0) {
            return false;
        }
        if (counts[ea] != counts[eb]) {
            return counts[ea] < counts[eb];
        }
        return p.last_use[ea] < p.last_use[eb];
    });

    size_t iv = 0;
    for (int32_t e : order) {
        if (!want[e]) {
            break;
        }
        if (p.slot_by_expert[e] >= 0) {
            p.last_use[e] = p.tick;
            continue;
        }
        policy_check(iv < victims.size(), "a victim slot for every wanted expert");
        const int32_t s   = victims[iv++];
        const int32_t old = p.expert_by_slot[s];
        if (old >= 0) {
            p.slot_by_expert[old] = -1;
            if (p.pf_unused[old]) {
                p.pf_unused[old] = 0;
                p.stats.prefetch_wasted++;
            }
        }
        p.expert_by_slot[s]  = e;
        p.slot_by_expert[e]    = s;
        p.admit_acc[e]  = 0.0;
        p.last_use[e]   = p.tick;
    }
}
