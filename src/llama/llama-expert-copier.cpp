#include "llama-expert-copier.h"

#include "llama-impl.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER (tests): the transfers that succeed before every later one fails; -1: unset
int64_t copy_fail_after() {
    static const int64_t after = [] {
        const char * s = getenv("LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER");
        return s != nullptr && *s != '\0' ? (int64_t) strtoll(s, nullptr, 10) : (int64_t) -1;
    }();
    return after;
}

std::atomic<int64_t> copy_count{0};
std::atomic<bool>    copy_failed{false};
std::mutex           copy_error_mtx;
std::string          copy_error;

} // namespace

bool llama_expert_copy_fault_armed() {
    return copy_fail_after() >= 0;
}

bool llama_expert_copy_fault(const llama_expert_transfer & t) {
    const int64_t after = copy_fail_after();
    if (after < 0 || copy_count.fetch_add(1) < after) {
        return false;
    }
    std::lock_guard<std::mutex> lock(copy_error_mtx);
    if (!copy_failed.load()) {
        copy_error = format("expert cache: copy of %zu bytes into %s at offset %zu failed (a test fault: "
            "LLAMA_MOE_CACHE_TEST_COPY_FAIL_AFTER=%lld); every decode now fails (load the model again)",
            t.size, ggml_get_name(t.bank), t.offset, (long long) after);
        LLAMA_LOG_ERROR("%s\n", copy_error.c_str());
        copy_failed = true;
    }
    return true;
}

bool llama_expert_copy_failed() {
    return copy_failed.load(std::memory_order_relaxed);
}

std::string llama_expert_copy_failure() {
    std::lock_guard<std::mutex> lock(copy_error_mtx);
    return copy_error;
}

bool llama_expert_transfer_run(const llama_expert_transfer & t) {
    if (llama_expert_copy_fault(t)) {
        return false;
    }
    switch (t.source) {
        case LLAMA_EXPERT_FROM_MEMORY:
            ggml_backend_tensor_set(t.bank, t.src, t.offset, t.size);
            return true;
        case LLAMA_EXPERT_FROM_FILE:
            return llama_expert_read_file(t.bank, *t.file, t.file_off, t.offset, t.size, t.name); // a failure marks the file
        case LLAMA_EXPERT_THROUGH_RAM:
            if (!llama_expert_read_file(t.ram, *t.file, t.file_off, t.ram_offset, t.size, t.name)) {
                return false;
            }
            ggml_backend_tensor_set(t.bank, (const char *) t.ram->data + t.ram_offset, t.offset, t.size);
            return true;
        case LLAMA_EXPERT_FROM_PACK: {
            if (t.rams == nullptr) {
                return llama_expert_pack_read(*t.pack, t.il, t.expert, t.banks, t.slot); // a failure marks the pack
            }
            if (!llama_expert_pack_read(*t.pack, t.il, t.expert, t.rams, t.ram_slot)) {
                return false;
            }
            const auto & L = t.pack->layers[t.il];
            for (size_t i = 0; i < L.size.size(); ++i) {
                ggml_backend_tensor_set(t.banks[i], (const char *) t.rams[i]->data + (size_t) t.ram_slot*L.size[i],
                    (size_t) t.slot*L.size[i], L.size[i]);
            }
            return true;
        }
    }
    return false;
}

namespace {

// every transfer at once, in the calling thread
struct copier_sync : llama_expert_copier {
    void submit(int32_t, bool, const llama_expert_transfer & t) override { (void) llama_expert_transfer_run(t); }
    void record(int32_t) override {}
    void wait(int32_t) override {}
    void wait_all() override {}
    const char * name() const override { return "synchronous copies"; }
    bool async() const override { return false; }
};

// a second backend instance of the device: copies on its own stream, one event per mark
struct copier_backend : llama_expert_copier {
    ggml_backend_t backend = nullptr;
    std::vector<ggml_backend_event_t> events;
    std::vector<bool> recorded;

    ~copier_backend() override {
        if (backend) {
            ggml_backend_synchronize(backend);
        }
        for (auto ev : events) {
            if (ev) {
                ggml_backend_event_free(ev);
            }
        }
        if (backend) {
            ggml_backend_free(backend);
        }
    }
    // a copy from memory is asynchronous; a read from the file is synchronous, and so is the read into the RAM tier
    // (pinned memory) of a transfer through it, whose copy to the device is asynchronous
    void submit(int32_t, bool, const llama_expert_transfer & t) override {
        if (llama_expert_copy_fault(t)) {
            return;
        }
        switch (t.source) {
            case LLAMA_EXPERT_FROM_MEMORY:
                ggml_backend_tensor_set_async(backend, t.bank, t.src, t.offset, t.size);
                break;
            case LLAMA_EXPERT_FROM_FILE:
                (void) llama_expert_read_file(t.bank, *t.file, t.file_off, t.offset, t.size, t.name); // a failure marks the file
                break;
            case LLAMA_EXPERT_THROUGH_RAM:
                if (llama_expert_read_file(t.ram, *t.file, t.file_off, t.ram_offset, t.size, t.name)) { // a failure marks the file
                    ggml_backend_tensor_set_async(backend, t.bank, (const char *) t.ram->data + t.ram_offset, t.offset, t.size);
                }
                break;
            case LLAMA_EXPERT_FROM_PACK:
                (void) llama_expert_transfer_run(t); // synchronous (read and copies); a failure marks the pack
                break;
        }
    }
    void record(int32_t m) override {
        ggml_backend_event_record(events[m], backend);
        recorded[m] = true;
    }
    void wait(int32_t m) override {
        if (recorded[m]) {
            ggml_backend_event_synchronize(events[m]);
            recorded[m] = false;
        }
    }
    void wait_all() override {
        ggml_backend_synchronize(backend);
        std::fill(recorded.begin(), recorded.end(), false);
    }
    const char * name() const override { return "a copy stream (second backend instance, events)"; }
};

// host threads that run the copies (or reads from the model file), urgent ones first; a mark counts the copies
// issued under it that have not completed
struct copier_thread : llama_expert_copier {
    struct job {
        int32_t               mark;
        llama_expert_transfer t;
    };
    std::mutex               mtx;
    std::condition_variable  cv_job;
    std::condition_variable  cv_done;
    std::deque<job>          urgent_jobs;
    std::deque<job>          jobs;
    std::vector<uint64_t>    pending;       // per mark: copies issued under it, not completed
    uint64_t                 in_flight = 0; // all marks
    uint32_t                 delay_us = 0;
    bool                     stop     = false;
    std::vector<std::thread> workers;

    copier_thread(int32_t n_marks, uint32_t delay, int32_t n_threads) : pending(n_marks, 0), delay_us(delay) {
        for (int32_t i = 0; i < std::max<int32_t>(1, n_threads); ++i) {
            workers.emplace_back([this] { run(); });
        }
    }
    ~copier_thread() override {
        {
            std::lock_guard<std::mutex> lock(mtx);
            stop = true;
        }
        cv_job.notify_all();
        for (auto & w : workers) {
            w.join();
        }
    }
    void run() {
        std::unique_lock<std::mutex> lock(mtx);
        while (true) {
            cv_job.wait(lock, [this] { return stop || !urgent_jobs.empty() || !jobs.empty(); });
            auto & q = !urgent_jobs.empty() ? urgent_jobs : jobs;
            if (q.empty()) {
                return; // stop, nothing left
            }
            const job j = q.front();
            q.pop_front();
            lock.unlock();
            if (delay_us > 0) {
                std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
            }
            (void) llama_expert_transfer_run(j.t); // a failed read marks the file
            lock.lock();
            pending[j.mark]--;
            in_flight--;
            cv_done.notify_all();
        }
    }
    void push(bool urgent, const job & j) {
        {
            std::lock_guard<std::mutex> lock(mtx);
            (urgent ? urgent_jobs : jobs).push_back(j);
            pending[j.mark]++;
            in_flight++;
        }
        cv_job.notify_one();
    }
    void submit(int32_t m, bool urgent, const llama_expert_transfer & t) override {
        push(urgent, { m, t });
    }
    void record(int32_t) override {} // the marks count their copies
    void wait(int32_t m) override {
        std::unique_lock<std::mutex> lock(mtx);
        cv_done.wait(lock, [this, m] { return pending[m] == 0; });
    }
    void wait_all() override {
        std::unique_lock<std::mutex> lock(mtx);
        cv_done.wait(lock, [this] { return in_flight == 0; });
    }
    const char * name() const override { return workers.size() > 1 ? "host reader threads" : "a host copy thread"; }
};

} // namespace

std::unique_ptr<llama_expert_copier> llama_expert_copier_backend(ggml_backend_dev_t dev, int32_t n_marks) {
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (!props.caps.async || !props.caps.events) {
        return nullptr;
    }
    auto c = std::make_unique<copier_backend>();
    c->backend = ggml_backend_dev_init(dev, nullptr);
    if (!c->backend) {
        return nullptr;
    }
    c->events.assign(n_marks, nullptr);
    c->recorded.assign(n_marks, false);
    for (int32_t m = 0; m < n_marks; ++m) {
        c->events[m] = ggml_backend_event_new(dev);
        if (!c->events[m]) {
            return nullptr;
        }
    }
    return c;
}

std::unique_ptr<llama_expert_copier> llama_expert_copier_thread(int32_t n_marks, uint32_t delay_us, int32_t n_threads) {
    return std::make_unique<copier_thread>(n_marks, delay_us, n_threads);
}

std::unique_ptr<llama_expert_copier> llama_expert_copier_sync() {
    return std::make_unique<copier_sync>();
}

std::unique_ptr<llama_expert_copier> llama_expert_copier_create(ggml_backend_dev_t dev, llama_expert_async async,
        bool host_file, int32_t readers, bool direct_reads, int32_t n_marks, int32_t il, const std::string & pfx,
        const char * who) {
    if (async == LLAMA_EXPERT_ASYNC_OFF) {
        return nullptr;
    }
    uint32_t delay_us = 0;
    if (const char * d = getenv("LLAMA_MOE_CACHE_TEST_COPY_DELAY_US")) {
        delay_us = (uint32_t) strtoul(d, nullptr, 10);
    }
    std::unique_ptr<llama_expert_copier> c;
    const bool host_banks = ggml_backend_buft_is_host(ggml_backend_dev_buffer_type(dev));
    if (async == LLAMA_EXPERT_ASYNC_THREAD || (host_file && host_banks)) {
        if (!host_banks) {
            throw std::runtime_error(pfx + "async=thread copies into banks in host memory, but the banks of "
                "layer " + std::to_string(il) + " are on " + ggml_backend_dev_name(dev) + ": use async=auto");
        }
        c = llama_expert_copier_thread(n_marks, delay_us, host_file ? readers : 1);
    } else {
        c = llama_expert_copier_backend(dev, n_marks);
    }
    if (c) {
        if (host_file && host_banks) {
            LLAMA_LOG_INFO("%s: host=file: %d reader thread(s) on %s, fetches first, background admissions "
                "after them; %s\n", who, readers, ggml_backend_dev_name(dev), direct_reads ? "O_DIRECT reads" : "buffered reads");
        } else {
            LLAMA_LOG_INFO("%s: background admissions: %s on %s\n", who, c->name(), ggml_backend_dev_name(dev));
        }
    } else {
        LLAMA_LOG_INFO("%s: background admissions: synchronous copies (%s offers no async copies with events)\n",
            who, ggml_backend_dev_name(dev));
    }
    return c;
}
