#pragma once

// The files the expert cache and llama-moe-sim open by path (the spec's profile=, profile_out=, stats=, trace=;
// llama-moe-sim's --trace): one that exists and is not a regular file is refused up front, in one line. Opening a
// FIFO blocks until its other end is opened (a tool that hangs forever before its first token); a device or a
// folder is no file to read or write. A standard stream of the process (/dev/stdout, /dev/stderr, /dev/stdin,
// /dev/fd/N, /proc/self/fd/N) is allowed: it is open already, so opening it again never blocks. The harness refuses
// the same paths before it starts a tool (harness/core/files.py). Call sites: llama_expert_cache_config_parse (the
// four keys), moe_sim_trace_read, llama-moe-sim's --stats.

#include <string>

#include <sys/stat.h>

// true when `path` is a regular file or does not exist (yet); else false with err = "<what><path> is <kind>, ..."
static inline bool llama_expert_path_check(const std::string & what, const std::string & path, std::string & err) {
#if defined(_WIN32)
    (void) what; (void) path; (void) err;
    return true;
#else
    // the standard streams, and /dev/null and /dev/full: devices that never block (a write to /dev/full fails with
    // ENOSPC at once, which the tests use to see that a failed final write is reported)
    for (const char * stream : { "/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/fd/", "/proc/self/fd/", "/dev/null",
                                 "/dev/full" }) {
        if (path.rfind(stream, 0) == 0) {
            return true;
        }
    }
    struct stat st;
    if (stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) {
        return true;
    }
    if (S_ISDIR(st.st_mode)) {
        err = what + path + " is a folder, not a file";
        return false;
    }
    const char * kind = S_ISFIFO(st.st_mode) ? "a FIFO (named pipe)" :
                        S_ISCHR(st.st_mode)  ? "a character device" :
                        S_ISBLK(st.st_mode)  ? "a block device" :
                        S_ISSOCK(st.st_mode) ? "a socket" : "not a regular file";
    err = what + path + " is " + kind + ", not a regular file: pass a file (opening it would block, or read and "
        "write without end)";
    return false;
#endif
}
