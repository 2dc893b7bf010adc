#include "llama-expert-writer.h"

#include "llama-expert-cache-impl.h"

#include "llama-impl.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

// the live caches with files; never destroyed, so that the thread may outlive the static destructors of an exit()
struct expert_writer {
    std::mutex                             mtx; // the list, and a write in progress
    std::vector<llama_expert_cache_impl *> caches;
};

expert_writer & the_writer() {
    static expert_writer * w = new expert_writer();
    return *w;
}

// the pipe's write end (the signal handler's side); -1 until the thread runs
std::atomic<int> g_request_fd{-1};
static_assert(std::atomic<int>::is_always_lock_free, "the request is made from a signal handler");

void writer_main(int fd) {
    char buf[64];
    for (;;) {
        const ssize_t n = read(fd, buf, sizeof(buf)); // requests that came together are one write
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return;
        }
        auto & w = the_writer();
        std::lock_guard<std::mutex> lock(w.mtx);
        for (auto * cache : w.caches) {
            cache->write_files_now("a termination signal");
        }
    }
}

} // namespace

void llama_expert_writer_add(llama_expert_cache_impl * cache) {
    auto & w = the_writer();
    std::lock_guard<std::mutex> lock(w.mtx);
    if (g_request_fd.load() < 0) {
        int fds[2];
        if (pipe(fds) != 0) {
            LLAMA_LOG_WARN("expert cache: no writer thread (pipe: %s): stats= and profile_out= are written at the end "
                "only\n", strerror(errno));
            return;
        }
        for (int fd : fds) {
            fcntl(fd, F_SETFD, FD_CLOEXEC);
        }
        fcntl(fds[1], F_SETFL, O_NONBLOCK); // a full pipe already holds a request
        std::thread(writer_main, fds[0]).detach();
        g_request_fd = fds[1];
    }
    w.caches.push_back(cache);
}

void llama_expert_writer_remove(llama_expert_cache_impl * cache) {
    auto & w = the_writer();
    std::lock_guard<std::mutex> lock(w.mtx);
    w.caches.erase(std::remove(w.caches.begin(), w.caches.end(), cache), w.caches.end());
}

void llama_expert_writer_request() {
    const int fd = g_request_fd.load(std::memory_order_relaxed);
    if (fd >= 0) {
        const int saved = errno;
        const char c = 1;
        (void) !write(fd, &c, 1);
        errno = saved;
    }
}

bool llama_expert_write_replacing(const std::string & path, const std::function<bool(const std::string &)> & write) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
        return write(path);
    }
    const std::string tmp = path + ".tmp." + std::to_string((long long) getpid());
    if (write(tmp) && rename(tmp.c_str(), path.c_str()) == 0) {
        return true;
    }
    const int err = errno;
    unlink(tmp.c_str());
    errno = err;
    return false;
}
