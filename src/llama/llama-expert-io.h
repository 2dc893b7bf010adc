#pragma once

// Reading experts from the model file (moe-subst, host=file): the file's descriptors and counters, where a mapped
// tensor lies in its file, and one read of an expert's bytes into a bank.

#include "ggml.h"
#include "ggml-backend.h"
#include "llama-expert-spec.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

// host=file: a model file the banks read from. fd: buffered reads; fd_direct: the same file opened with O_DIRECT
// (-1 when refused or direct=off); direct: whether reads use fd_direct (cleared, once, when the file system
// refuses an O_DIRECT read). The counters are summed over the threads that read.
// the blocks of 4 KiB that a file's sample hash reads (llama_expert_file::sample_hash)
#define LLAMA_EXPERT_FILE_SAMPLES 64

// the sample hash of the file open at fd, of `size` bytes; 0 when a read fails
uint64_t llama_expert_file_sample_hash(int fd, uint64_t size);

struct llama_expert_file {
    std::string           path;
    int                   fd        = -1;
    int                   fd_direct = -1;
    std::atomic<bool>     direct{false};
    std::atomic<uint64_t> reads{0};
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> ns{0};
    bool                  test_refuse_read = false; // tests: O_DIRECT reads fail with EINVAL
    // the most bytes one O_DIRECT read takes (the largest expert slice the engine reads from this file; 0: any): a
    // longer run is read in pieces, so that a reader's aligned buffer stays what the ram= budget counts
    size_t                piece = 0;

    // the file as opened (fstat of fd): a later size or modification time of the descriptor's file means that it was
    // rewritten or truncated in place; another inode at path means it was replaced (renamed over) or removed
    uint64_t              size     = 0;
    std::atomic<int64_t>  mtime_ns{0};
    // a hash of LLAMA_EXPERT_FILE_SAMPLES blocks spread over the file, taken when it was opened: a later modification
    // time with the same size and the same sampled bytes (a `touch`) is not a change (one warning); 0: not taken
    uint64_t              sample_hash = 0;
    uint64_t              dev      = 0;
    uint64_t              ino      = 0;
    std::atomic<bool>     warned_replaced{false};

    // a failed read (the file truncated or damaged after loading, a read error) or a change of the file in place:
    // the first one's message
    std::atomic<bool>     failed{false};
    std::mutex            error_mtx;
    std::string           error;
};

// host=file: read size bytes at file_off of f into bank at offset (synchronously; with O_DIRECT the aligned span
// around them into a buffer of the calling thread, else buffered reads whose pages are then dropped from the page
// cache). On a short read or a read error (the model file was truncated or damaged after loading: moving or
// replacing it is harmless, the engine holds its own descriptors), or when the file changed in place by the end of
// the read (llama_expert_file_check's first test: one fstat, next to the pread and posix_fadvise of every read),
// returns false, having logged one line naming the read, the tensor and the file, or the file and what changed (the
// first failure of the file) and marked the file failed: the engine can no longer serve that file's experts, and the
// cache then ends every compute (llama_decode returns 2)
bool llama_expert_read_file(ggml_tensor * bank, llama_expert_file & f, uint64_t file_off, size_t offset, size_t size,
                            const char * tensor_name);


// host=file with an expert pack (llama-expert-pack.h): one part of a record read, the bytes at src_off of the span
// read into dst at offset
struct llama_expert_read_part {
    ggml_tensor * dst     = nullptr;
    size_t        offset  = 0;
    size_t        src_off = 0;
    size_t        size    = 0;
};

// host=file with an expert pack: one read of size bytes at file_off of f, scattered into parts (which tile
// [0, size) in order of src_off). With O_DIRECT the aligned span (a pack's record is aligned: one aligned read)
// into the calling thread's aligned buffer, then copies into the parts; buffered: one preadv straight into the
// parts where they are host memory (else a staging buffer), the pages then dropped. Failures as
// llama_expert_read_file's (what: the read's name for the message). Counts one read of size bytes.
bool llama_expert_read_file_parts(llama_expert_file & f, uint64_t file_off, size_t size,
                                  const llama_expert_read_part * parts, size_t n_parts, const char * what);

// host=file: whether the model file is still the one opened, checked once per ubatch (the route step of the first MoE
// layer) and after every read. Its size or modification time changed (fstat of the descriptor: it was rewritten or
// truncated in place, so the experts read from it, and the loader's mapping of the other weights, are no longer the
// loaded model's, even when the bytes written were the same): false, the file marked failed and one line logged, as
// for a failed read. Its path names another file (stat: renamed over, or removed): one warning, once, and true: the
// descriptors and the loader's mapping still hold the file that was loaded, which nothing changed.
bool llama_expert_file_check(llama_expert_file & f);

// host=file: open a model file for buffered reads and, unless direct=off, with O_DIRECT (refused on some file
// systems, e.g. tmpfs: direct=auto falls back to buffered reads and says so, direct=on is an error). Throws
// std::runtime_error, its message prefixed with pfx, when the file cannot be opened.
std::unique_ptr<llama_expert_file> llama_expert_file_open(const std::string & path, llama_expert_direct direct,
                                                          const std::string & pfx);

// host=file: the file and offset that a pointer into a file mapping reads, from /proc/self/maps (the model loader
// keeps its mappings private); false when p is not in a file mapping (the model was not loaded with mmap)
bool llama_expert_mapped_file_of(const void * p, std::string & path, uint64_t & off);
