#include "llama-expert-health.h"

#include <atomic>
#include <mutex>

static std::mutex       health_mtx;
static std::atomic_bool health_failed{false};
static std::string      health_why;

void llama_expert_health_fail(const std::string & why) {
    if (health_failed.load(std::memory_order_acquire)) {
        return;
    }
    std::lock_guard<std::mutex> lock(health_mtx);
    if (!health_failed.load(std::memory_order_relaxed)) {
        health_why = why.empty() ? std::string("expert cache: a compute failed") : why;
        health_failed.store(true, std::memory_order_release);
    }
}

std::string llama_expert_health_failure() {
    if (!health_failed.load(std::memory_order_acquire)) {
        return std::string();
    }
    std::lock_guard<std::mutex> lock(health_mtx);
    return health_why;
}
