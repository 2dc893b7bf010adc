#include "llama-expert-copier.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace {

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
    void copy(int32_t, bool, ggml_tensor * bank, const void * src, size_t offset, size_t size) override {
        ggml_backend_tensor_set_async(backend, bank, src, offset, size);
    }
    // three tiers: the read into the RAM tier (pinned memory) is synchronous, its copy to the device asynchronous
    void read_through(int32_t, bool, ggml_tensor * ram, llama_expert_file & f, uint64_t file_off, size_t ram_offset,
                      size_t size, const char * name, ggml_tensor * bank, size_t offset) override {
        if (llama_expert_read_file(ram, f, file_off, ram_offset, size, name)) { // a failure marks the file
            ggml_backend_tensor_set_async(backend, bank, (const char *) ram->data + ram_offset, offset, size);
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
        int32_t             mark;
        ggml_tensor *       bank;
        const void *        src;
        size_t              offset;
        size_t              size;
        llama_expert_file * file     = nullptr; // host=file: read from the model file instead of src
        uint64_t            file_off = 0;
        const char *        name     = nullptr;
        ggml_tensor *       then_bank   = nullptr; // three tiers: then copy the bytes read into this bank
        size_t              then_offset = 0;
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
            if (j.file != nullptr) {
                // a failure marks the file
                if (llama_expert_read_file(j.bank, *j.file, j.file_off, j.offset, j.size, j.name) && j.then_bank) {
                    ggml_backend_tensor_set(j.then_bank, (const char *) j.bank->data + j.offset, j.then_offset, j.size);
                }
            } else {
                ggml_backend_tensor_set(j.bank, j.src, j.offset, j.size);
            }
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
    void copy(int32_t m, bool urgent, ggml_tensor * bank, const void * src, size_t offset, size_t size) override {
        push(urgent, { m, bank, src, offset, size });
    }
    void read(int32_t m, bool urgent, ggml_tensor * bank, llama_expert_file & f, uint64_t file_off, size_t offset,
              size_t size, const char * name) override {
        push(urgent, { m, bank, nullptr, offset, size, &f, file_off, name });
    }
    void read_through(int32_t m, bool urgent, ggml_tensor * ram, llama_expert_file & f, uint64_t file_off,
                      size_t ram_offset, size_t size, const char * name, ggml_tensor * bank, size_t offset) override {
        push(urgent, { m, ram, nullptr, ram_offset, size, &f, file_off, name, bank, offset });
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
