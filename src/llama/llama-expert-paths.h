#pragma once

// The files the expert cache and llama-moe-sim open by path (the spec's profile=, profile_out=, stats=, trace=;
// llama-moe-sim's --trace): one that exists and is not a regular file is refused up front, in one line. Opening a
// FIFO blocks until its other end is opened (a tool that hangs forever before its first token); a device or a
// folder is no file to read or write. A standard stream of the process (/dev/stdout, /dev/stderr, /dev/stdin,
// /dev/fd/N, /proc/self/fd/N) is allowed: it is open already, so opening it again never blocks. The harness refuses
// the same paths before it starts a tool (harness/core/files.py). Call sites: llama_expert_cache_config_parse (the
// four keys), moe_sim_trace_read, llama-moe-sim's --stats.
//
// llama_expert_path_same tells whether two of those keys name one file (llama_expert_cache_config_parse refuses
// stats= and trace= on one path, which would destroy both files and exit 0).

#include <string>
#include <vector>

#include <sys/stat.h>

// the streams and devices that llama_expert_path_check allows: open already or never blocking, and no file to lose
static inline bool llama_expert_path_is_stream(const std::string & path) {
    for (const char * stream : { "/dev/stdout", "/dev/stderr", "/dev/stdin", "/dev/fd/", "/proc/self/fd/", "/dev/null",
                                 "/dev/full" }) {
        if (path.rfind(stream, 0) == 0) {
            return true;
        }
    }
    return false;
}

// a path's text normalised: repeated '/' collapsed, "." components and a trailing '/' dropped ("./out//s.json" ->
// "out/s.json"); ".." is kept (through a symbolic link it need not go back to the folder it seems to)
static inline std::string llama_expert_path_normal(const std::string & path) {
    std::vector<std::string> parts;
    size_t pos = 0;
    while (pos <= path.size()) {
        size_t end = path.find('/', pos);
        if (end == std::string::npos) {
            end = path.size();
        }
        const std::string part = path.substr(pos, end - pos);
        if (!part.empty() && part != ".") {
            parts.push_back(part);
        }
        pos = end + 1;
    }
    std::string out = !path.empty() && path[0] == '/' ? "/" : "";
    for (size_t i = 0; i < parts.size(); ++i) {
        out += (i ? "/" : "") + parts[i];
    }
    return out.empty() ? "." : out;
}

// true when a and b name one file: the same text after llama_expert_path_normal, or one existing file (the same
// st_dev and st_ino: a hard link, a symbolic link, another spelling), or, when neither exists yet, the same name in
// one existing folder. A standard stream or device (llama_expert_path_is_stream) is no file: false
static inline bool llama_expert_path_same(const std::string & a, const std::string & b) {
    if (llama_expert_path_is_stream(a) || llama_expert_path_is_stream(b)) {
        return false;
    }
    const std::string na = llama_expert_path_normal(a), nb = llama_expert_path_normal(b);
    if (na == nb) {
        return true;
    }
#if defined(_WIN32)
    return false;
#else
    struct stat sa, sb;
    const bool ea = stat(na.c_str(), &sa) == 0, eb = stat(nb.c_str(), &sb) == 0;
    if (ea || eb) {
        return ea && eb && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    }
    const size_t sla = na.rfind('/'), slb = nb.rfind('/');
    const std::string base_a = sla == std::string::npos ? na : na.substr(sla + 1);
    const std::string base_b = slb == std::string::npos ? nb : nb.substr(slb + 1);
    const std::string dir_a  = sla == std::string::npos ? "." : sla == 0 ? "/" : na.substr(0, sla);
    const std::string dir_b  = slb == std::string::npos ? "." : slb == 0 ? "/" : nb.substr(0, slb);
    return base_a == base_b && base_a != ".." && stat(dir_a.c_str(), &sa) == 0 && stat(dir_b.c_str(), &sb) == 0 &&
        sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
#endif
}

// true when `path` is a regular file or does not exist (yet); else false with err = "<what><path> is <kind>, ..."
static inline bool llama_expert_path_check(const std::string & what, const std::string & path, std::string & err) {
#if defined(_WIN32)
    (void) what; (void) path; (void) err;
    return true;
#else
    // the standard streams, and /dev/null and /dev/full: devices that never block (a write to /dev/full fails with
    // ENOSPC at once, which the tests use to see that a failed final write is reported)
    if (llama_expert_path_is_stream(path)) {
        return true;
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
