#include "llama-expert-io.h"

#include "llama-impl.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

bool llama_expert_mapped_file_of(const void * p, std::string & path, uint64_t & off) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    const uintptr_t a = (uintptr_t) p;
    while (std::getline(maps, line)) {
        unsigned long long lo = 0, hi = 0, foff = 0;
        char perms[8] = {}, dev[16] = {};
        unsigned long long inode = 0;
        int pos = 0;
        if (sscanf(line.c_str(), "%llx-%llx %7s %llx %15s %llu %n", &lo, &hi, perms, &foff, dev, &inode, &pos) < 6) {
            continue;
        }
        if (a < lo || a >= hi || inode == 0 || pos <= 0 || (size_t) pos >= line.size() || line[pos] != '/') {
            continue;
        }
        path = line.substr(pos);
        off  = foff + (a - lo);
        return true;
    }
    return false;
}

// O_DIRECT alignment of file offsets, lengths and buffers (the logical block size of common devices is 512 or 4096)
static constexpr size_t DIRECT_ALIGN = 4096;

// the calling thread's buffer for O_DIRECT reads, aligned, grown as needed
static char * direct_buffer(size_t size) {
    struct buf {
        char * p = nullptr;
        size_t n = 0;
        ~buf() { free(p); }
    };
    thread_local buf b;
    if (b.n < size) {
        free(b.p);
        b.p = nullptr;
        b.n = 0;
        void * p = nullptr;
        if (posix_memalign(&p, DIRECT_ALIGN, size) != 0) {
            return nullptr;
        }
        b.p = (char *) p;
        b.n = size;
    }
    return b.p;
}

// pread until size bytes are read; the bytes read, or -errno (0 bytes read at the end of the file: short read)
static ssize_t read_full(int fd, char * dst, size_t size, uint64_t off) {
    size_t done = 0;
    while (done < size) {
        const ssize_t r = pread(fd, dst + done, size - done, (off_t) (off + done));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            return -errno;
        }
        if (r == 0) {
            break;
        }
        done += (size_t) r;
    }
    return (ssize_t) done;
}

// a failed read: the file's first failure is logged and kept; false
static bool read_failed(llama_expert_file & f, ssize_t r, size_t size, const char * tensor_name, uint64_t off) {
    std::lock_guard<std::mutex> lock(f.error_mtx);
    if (!f.failed.load()) {
        f.error = format("expert cache: host=file: %s of %zu bytes of %s at offset %llu of %s%s%s: the model file was "
            "truncated or damaged after loading; every decode now fails (restore the file and load the model again)",
            r < 0 ? "read error" : "short read", size, tensor_name, (unsigned long long) off, f.path.c_str(),
            r < 0 ? ": " : "", r < 0 ? strerror((int) -r) : "");
        LLAMA_LOG_ERROR("%s\n", f.error.c_str());
        f.failed = true;
    }
    return false;
}

static int64_t mtime_ns_of(const struct stat & st) {
    return (int64_t) st.st_mtim.tv_sec * 1000000000 + (int64_t) st.st_mtim.tv_nsec;
}

static std::string format_mtime(int64_t ns) {
    return format("%lld.%09lld", (long long) (ns / 1000000000), (long long) (ns % 1000000000));
}

uint64_t llama_expert_file_sample_hash(int fd, uint64_t size) {
    uint64_t h = 1469598103934665603ull; // FNV-1a, over the blocks and their offsets
    std::vector<char> block(4096);
    for (uint64_t i = 0; i <= LLAMA_EXPERT_FILE_SAMPLES; ++i) {
        const uint64_t at  = size <= 4096 ? 0 : (size - 4096) / LLAMA_EXPERT_FILE_SAMPLES * i;
        const size_t   len = (size_t) std::min<uint64_t>(4096, size);
        const ssize_t  r   = read_full(fd, block.data(), len, at);
        if (r != (ssize_t) len) {
            return 0;
        }
        for (size_t j = 0; j < len; ++j) {
            h = (h ^ (uint8_t) block[j]) * 1099511628211ull;
        }
        h = (h ^ at) * 1099511628211ull;
    }
    return h == 0 ? 1 : h;
}

// the descriptor's file against the file as opened: false (the file marked failed, its first failure logged) when its
// size or modification time changed; a modification time alone, with the sampled bytes unchanged (a `touch`), is
// taken as the file's new time with one warning
static bool file_unchanged(llama_expert_file & f) {
    struct stat st;
    if (fstat(f.fd, &st) != 0) {
        return true; // nothing to compare; a read reports its own errors
    }
    const uint64_t size  = (uint64_t) st.st_size;
    const int64_t  mtime = mtime_ns_of(st);
    if (size == f.size && mtime == f.mtime_ns.load(std::memory_order_relaxed)) {
        return true;
    }
    std::lock_guard<std::mutex> lock(f.error_mtx);
    if (size == f.size && mtime == f.mtime_ns.load()) {
        return true; // another reader took the new time meanwhile
    }
    if (!f.failed.load() && size == f.size && f.sample_hash != 0 &&
            llama_expert_file_sample_hash(f.fd, size) == f.sample_hash) {
        LLAMA_LOG_WARN("expert cache: host=file: the modification time of %s changed (%s -> %s) and its size and "
            "sampled bytes (%d blocks) did not: going on (a rewrite in place that keeps the size and those blocks "
            "would not be seen; load the model again after changing it)\n", f.path.c_str(),
            format_mtime(f.mtime_ns.load()).c_str(), format_mtime(mtime).c_str(), LLAMA_EXPERT_FILE_SAMPLES + 1);
        f.mtime_ns = mtime;
        return true;
    }
    if (!f.failed.load()) {
        std::string what;
        if (size != f.size) {
            what = format("size %llu -> %llu bytes", (unsigned long long) f.size, (unsigned long long) size);
        }
        if (mtime != f.mtime_ns) {
            what += (what.empty() ? "" : ", ") + format("modified %s -> %s", format_mtime(f.mtime_ns.load()).c_str(),
                format_mtime(mtime).c_str());
        }
        f.error = format("expert cache: host=file: the model file %s changed after loading (%s): it was rewritten or "
            "truncated in place; every decode now fails (restore the file and load the model again)",
            f.path.c_str(), what.c_str());
        LLAMA_LOG_ERROR("%s\n", f.error.c_str());
        f.failed = true;
    }
    return false;
}

bool llama_expert_file_check(llama_expert_file & f) {
    if (f.failed.load(std::memory_order_relaxed) || !file_unchanged(f)) {
        return false;
    }
    if (!f.warned_replaced.load(std::memory_order_relaxed)) {
        struct stat st;
        const bool gone = stat(f.path.c_str(), &st) != 0;
        if ((gone || (uint64_t) st.st_dev != f.dev || (uint64_t) st.st_ino != f.ino) && !f.warned_replaced.exchange(true)) {
            const std::string now = gone ? format("removed: %s", strerror(errno))
                                         : format("inode %llu -> %llu", (unsigned long long) f.ino, (unsigned long long) st.st_ino);
            LLAMA_LOG_WARN("expert cache: host=file: the path of the model file %s now names another file or none (%s): "
                "this process keeps reading the file it loaded, which is unchanged; load the model again to use the "
                "new one\n", f.path.c_str(), now.c_str());
        }
    }
    return true;
}

// one span of a read into bank at offset: O_DIRECT into this thread's aligned buffer, else buffered; false on a failed
// read (logged, the file marked)
static bool read_file_span(ggml_tensor * bank, llama_expert_file & f, uint64_t file_off, size_t offset, size_t size,
                           const char * tensor_name) {
    const bool host = ggml_backend_buffer_is_host(bank->buffer);
    const char * src = nullptr;
    std::vector<char> staging;
    if (f.direct.load(std::memory_order_relaxed)) {
        // the aligned span around the bytes, into this thread's aligned buffer
        const uint64_t lo = file_off & ~(uint64_t) (DIRECT_ALIGN - 1);
        const uint64_t hi = (file_off + size + DIRECT_ALIGN - 1) & ~(uint64_t) (DIRECT_ALIGN - 1);
        char * buf = direct_buffer((size_t) (hi - lo));
        const ssize_t r = !buf ? -ENOMEM : f.test_refuse_read ? -EINVAL : read_full(f.fd_direct, buf, (size_t) (hi - lo), lo);
        if (r == -EINVAL || r == -ENOMEM) {
            // the file system refuses O_DIRECT reads after all (or no buffer): buffered reads from now on, said once
            if (f.direct.exchange(false)) {
                LLAMA_LOG_WARN("expert cache: host=file: O_DIRECT reads of %s refused (%s): buffered reads from now on\n",
                    f.path.c_str(), strerror((int) -r));
            }
        } else if (r < (ssize_t) (file_off + size - lo)) {
            return read_failed(f, r, size, tensor_name, file_off);
        } else {
            src = buf + (file_off - lo);
        }
    }
    if (src == nullptr) {
        char * dst = nullptr;
        if (host) {
            dst = (char *) bank->data + offset;
        } else {
            staging.resize(size);
            dst = staging.data();
        }
        const ssize_t r = read_full(f.fd, dst, size, file_off);
        if (r != (ssize_t) size) {
            return read_failed(f, r, size, tensor_name, file_off);
        }
        posix_fadvise(f.fd, (off_t) file_off, (off_t) size, POSIX_FADV_DONTNEED);
        src = host ? nullptr : dst;
    }
    if (src != nullptr) {
        if (host) {
            memcpy((char *) bank->data + offset, src, size);
        } else {
            ggml_backend_tensor_set(bank, src, offset, size);
        }
    }
    return true;
}

bool llama_expert_read_file(ggml_tensor * bank, llama_expert_file & f, uint64_t file_off, size_t offset, size_t size,
                            const char * tensor_name) {
    const auto t0 = std::chrono::steady_clock::now();
    // a run of experts (the initial fill reads one run of all the slots) a piece at a time with O_DIRECT, so that
    // this thread's aligned buffer stays what the ram= budget counts for it (readers: the largest slice and two
    // blocks); the whole run in one buffer held 12 MiB more in 4 readers beside 466 slots of 0.15 MiB (studymoe)
    const size_t piece = f.piece > 0 && f.direct.load(std::memory_order_relaxed) ? f.piece : size;
    for (size_t done = 0; done < size; done += piece) {
        if (!read_file_span(bank, f, file_off + done, offset + done, std::min(piece, size - done), tensor_name)) {
            return false;
        }
    }
    if (!file_unchanged(f)) {
        return false; // what was read may be of the changed file
    }
    f.reads.fetch_add(1, std::memory_order_relaxed);
    f.bytes.fetch_add(size, std::memory_order_relaxed);
    f.ns.fetch_add((uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t0).count(), std::memory_order_relaxed);
    return true;
}

// preadv until every byte of iov[0..n) is read; the bytes read, or -errno (a short read at the end of the file)
static ssize_t readv_full(int fd, struct iovec * iov, int n, uint64_t off) {
    size_t done = 0;
    int i = 0;
    while (i < n) {
        const ssize_t r = preadv(fd, iov + i, n - i, (off_t) (off + done));
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            return -errno;
        }
        if (r == 0) {
            break;
        }
        done += (size_t) r;
        size_t left = (size_t) r;
        while (i < n && left >= iov[i].iov_len) {
            left -= iov[i].iov_len;
            ++i;
        }
        if (i < n) {
            iov[i].iov_base = (char *) iov[i].iov_base + left;
            iov[i].iov_len -= left;
        }
    }
    return (ssize_t) done;
}

bool llama_expert_read_file_parts(llama_expert_file & f, uint64_t file_off, size_t size,
                                  const llama_expert_read_part * parts, size_t n_parts, const char * what) {
    const auto t0 = std::chrono::steady_clock::now();
    bool done = false;
    if (f.direct.load(std::memory_order_relaxed)) {
        // one aligned read of the span into this thread's aligned buffer, then a copy of each part
        const uint64_t lo = file_off & ~(uint64_t) (DIRECT_ALIGN - 1);
        const uint64_t hi = (file_off + size + DIRECT_ALIGN - 1) & ~(uint64_t) (DIRECT_ALIGN - 1);
        char * buf = direct_buffer((size_t) (hi - lo));
        const ssize_t r = !buf ? -ENOMEM : f.test_refuse_read ? -EINVAL : read_full(f.fd_direct, buf, (size_t) (hi - lo), lo);
        if (r == -EINVAL || r == -ENOMEM) {
            if (f.direct.exchange(false)) {
                LLAMA_LOG_WARN("expert cache: host=file: O_DIRECT reads of %s refused (%s): buffered reads from now on\n",
                    f.path.c_str(), strerror((int) -r));
            }
        } else if (r < (ssize_t) (file_off + size - lo)) {
            return read_failed(f, r, size, what, file_off);
        } else {
            const char * src = buf + (file_off - lo);
            for (size_t i = 0; i < n_parts; ++i) {
                const auto & p = parts[i];
                if (ggml_backend_buffer_is_host(p.dst->buffer)) {
                    memcpy((char *) p.dst->data + p.offset, src + p.src_off, p.size);
                } else {
                    ggml_backend_tensor_set(p.dst, src + p.src_off, p.offset, p.size);
                }
            }
            done = true;
        }
    }
    if (!done) {
        // buffered: one preadv into the parts (host memory), or into a staging buffer for the others
        std::vector<char> staging;
        std::vector<struct iovec> iov(n_parts);
        size_t pos = 0;
        for (size_t i = 0; i < n_parts; ++i) {
            const auto & p = parts[i];
            GGML_ASSERT(p.src_off == pos && "expert pack: the parts of a read must tile it in order");
            pos += p.size;
            if (ggml_backend_buffer_is_host(p.dst->buffer)) {
                iov[i].iov_base = (char *) p.dst->data + p.offset;
            } else {
                staging.resize(size);
                iov[i].iov_base = nullptr; // set below, once staging has its final size
            }
            iov[i].iov_len = p.size;
        }
        GGML_ASSERT(pos == size);
        for (size_t i = 0; i < n_parts; ++i) {
            if (iov[i].iov_base == nullptr) {
                iov[i].iov_base = staging.data() + parts[i].src_off;
            }
        }
        const ssize_t r = readv_full(f.fd, iov.data(), (int) n_parts, file_off);
        if (r != (ssize_t) size) {
            return read_failed(f, r, size, what, file_off);
        }
        posix_fadvise(f.fd, (off_t) file_off, (off_t) size, POSIX_FADV_DONTNEED);
        for (size_t i = 0; i < n_parts; ++i) {
            const auto & p = parts[i];
            if (!ggml_backend_buffer_is_host(p.dst->buffer)) {
                ggml_backend_tensor_set(p.dst, staging.data() + p.src_off, p.offset, p.size);
            }
        }
    }
    if (!file_unchanged(f)) {
        return false; // what was read may be of the changed file
    }
    f.reads.fetch_add(1, std::memory_order_relaxed);
    f.bytes.fetch_add(size, std::memory_order_relaxed);
    f.ns.fetch_add((uint64_t) std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t0).count(), std::memory_order_relaxed);
    return true;
}

std::unique_ptr<llama_expert_file> llama_expert_file_open(const std::string & path, llama_expert_direct direct,
                                                          const std::string & pfx) {
    auto f = std::make_unique<llama_expert_file>();
    f->path = path;
    f->fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd < 0) {
        throw std::runtime_error(pfx + "host=file: cannot open " + path + ": " + strerror(errno));
    }
    struct stat st;
    if (fstat(f->fd, &st) != 0) {
        const int err = errno;
        close(f->fd);
        throw std::runtime_error(pfx + "host=file: cannot stat " + path + ": " + strerror(err));
    }
    f->size     = (uint64_t) st.st_size;
    f->mtime_ns = mtime_ns_of(st);
    f->dev      = (uint64_t) st.st_dev;
    f->ino      = (uint64_t) st.st_ino;
    f->sample_hash = llama_expert_file_sample_hash(f->fd, f->size);
    if (direct != LLAMA_EXPERT_DIRECT_OFF) {
#ifdef O_DIRECT
        // tests: LLAMA_MOE_CACHE_TEST_DIRECT=refuse-open|refuse-read plays a file system that refuses O_DIRECT
        const char * test = getenv("LLAMA_MOE_CACHE_TEST_DIRECT");
        f->fd_direct = test && strcmp(test, "refuse-open") == 0 ? (errno = EINVAL, -1)
                                                                : open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
        const int err = errno;
        f->test_refuse_read = test && strcmp(test, "refuse-read") == 0;
#else
        const int err = ENOTSUP;
#endif
        if (f->fd_direct < 0) {
            if (direct == LLAMA_EXPERT_DIRECT_ON) {
                close(f->fd);
                throw std::runtime_error(pfx + "direct=on: the file system of " + path + " refuses O_DIRECT (" +
                    strerror(err) + "): use direct=auto or direct=off (buffered reads)");
            }
            LLAMA_LOG_INFO("%s: host=file: O_DIRECT refused for %s (%s): buffered reads, pages dropped after each read\n",
                __func__, path.c_str(), strerror(err));
        }
        f->direct = f->fd_direct >= 0;
    }
    return f;
}
