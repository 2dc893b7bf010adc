// glslc with a cache of its outputs, for `./build.sh --vulkan` (which compiles this file and names it to CMake as
// Vulkan_GLSLC_EXECUTABLE).
//
// The stock and the patched trees build ggml-vulkan from the same ggml sources (no patch touches ggml/), and its
// shaders are compiled by glslc, which ccache cannot cache: about 6 CPU-minutes a tree (measured 2026-12-02), paid
// twice in every cold CI run. This wrapper runs the real glslc once per distinct compile and copies the SPIR-V (and
// the dependency file, its paths rewritten) for the second tree. A compiled wrapper, not a script: it runs once per
// shader variant, thousands of times a tree, where a Python interpreter's start alone (0.2 s on the CI machine) would
// cost more than the cache saves.
//
// The key of a compile: its arguments without the output and dependency-file paths (the input by its file name,
// not its folder), the real glslc's path, size and modification time, and the bytes of every file in the input's folder
// (the shaders include only files beside them), hashed (two 64-bit FNV-1a). Anything else (a configure-time probe
// writing to stdout, no single .comp input) runs the real glslc unchanged, as does any failure of the cache itself.
//
//   MOE_SUBST_GLSLC        the real glslc (default: glslc on PATH)
//   MOE_SUBST_GLSLC_CACHE  the cache folder (default: ~/.cache/moe-subst/glslc; "off": no cache)
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static const char * real_glslc() {
    const char * env = getenv("MOE_SUBST_GLSLC");
    return env && *env ? env : "glslc";
}

[[noreturn]] static void run_real(char ** argv) {
    argv[0] = (char *) real_glslc();
    execvp(argv[0], argv);
    perror("glslc_cache: cannot run glslc (set MOE_SUBST_GLSLC)");
    _exit(127);
}

static bool read_file(const std::string & path, std::string & out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::ostringstream ss;
    ss << f.rdbuf();
    out = ss.str();
    return !f.bad();
}

static bool write_atomic(const std::string & path, const std::string & data) {
    const std::string tmp = path + ".tmp." + std::to_string(getpid());
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        if (!f || !f.write(data.data(), (std::streamsize) data.size())) {
            unlink(tmp.c_str());
            return false;
        }
    }
    if (rename(tmp.c_str(), path.c_str()) != 0) {
        unlink(tmp.c_str());
        return false;
    }
    return true;
}

static std::string replace_all(std::string s, const std::string & from, const std::string & to) {
    if (from.empty()) {
        return s;
    }
    for (size_t pos = 0; (pos = s.find(from, pos)) != std::string::npos; pos += to.size()) {
        s.replace(pos, from.size(), to);
    }
    return s;
}

struct hash128 {
    uint64_t a = 1469598103934665603ull;
    uint64_t b = 1099511628211ull * 7919ull;
    void add(const std::string & s) {
        for (unsigned char c : s) {
            a = (a ^ c) * 1099511628211ull;
            b = (b ^ c) * 0x100000001b3ull + 0x9e3779b97f4a7c15ull;
        }
        a = (a ^ 0xff) * 1099511628211ull; // a separator: "ab","c" and "a","bc" differ
        b = (b ^ 0xff) * 0x100000001b3ull;
    }
    std::string hex() const {
        char buf[40];
        snprintf(buf, sizeof(buf), "%016llx%016llx", (unsigned long long) a, (unsigned long long) b);
        return buf;
    }
};

static bool mkdirs(const std::string & path) {
    for (size_t pos = 1; pos <= path.size(); ++pos) {
        if (pos == path.size() || path[pos] == '/') {
            const std::string p = path.substr(0, pos);
            if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) {
                return false;
            }
        }
    }
    return true;
}

int main(int argc, char ** argv) {
    std::string cache;
    if (const char * env = getenv("MOE_SUBST_GLSLC_CACHE"); env && *env) {
        cache = env;
    } else if (const char * xdg = getenv("XDG_CACHE_HOME"); xdg && *xdg) {
        cache = std::string(xdg) + "/moe-subst/glslc";
    } else if (const char * home = getenv("HOME"); home && *home) {
        cache = std::string(home) + "/.cache/moe-subst/glslc";
    }
    std::vector<std::string> args(argv + 1, argv + argc);
    int o = -1, d = -1, in = -1, n_in = 0;
    for (int i = 0; i < (int) args.size(); ++i) {
        if (args[i] == "-o" && i + 1 < (int) args.size()) {
            o = i + 1;
        } else if (args[i] == "-MF" && i + 1 < (int) args.size()) {
            d = i + 1;
        } else if (args[i].size() > 5 && args[i][0] != '-' && args[i].compare(args[i].size() - 5, 5, ".comp") == 0) {
            in = i;
            n_in++;
        }
    }
    if (cache.empty() || cache == "off" || o < 0 || args[o] == "-" || n_in != 1 || !mkdirs(cache)) {
        run_real(argv);
    }
    const std::string & src  = args[in];
    const std::string   dir  = src.find('/') == std::string::npos ? "." : src.substr(0, src.rfind('/'));
    const std::string & out  = args[o];
    const std::string   dep  = d >= 0 ? args[d] : "";

    hash128 h;
    for (int i = 0; i < (int) args.size(); ++i) {
        if (i == o || i == o - 1 || (d >= 0 && (i == d || i == d - 1))) {
            continue;
        }
        // the input by its name in the folder (the folder's files are hashed below; its path differs between trees)
        h.add(i == in ? "@IN@/" + src.substr(src.rfind('/') + 1) : args[i]);
    }
    struct stat st;
    if (stat(real_glslc(), &st) == 0) {
        h.add(std::string(real_glslc()) + ":" + std::to_string(st.st_size) + ":" + std::to_string(st.st_mtime));
    } else {
        h.add(real_glslc()); // (found on PATH: its name)
    }
    std::vector<std::string> names;
    if (DIR * dp = opendir(dir.c_str())) {
        while (dirent * e = readdir(dp)) {
            names.emplace_back(e->d_name);
        }
        closedir(dp);
    } else {
        run_real(argv);
    }
    std::sort(names.begin(), names.end());
    for (const auto & n : names) {
        std::string bytes;
        const std::string p = dir + "/" + n;
        if (stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && read_file(p, bytes)) {
            h.add(n);
            h.add(bytes);
        }
    }
    const std::string key  = cache + "/" + h.hex();
    std::string spv, deps;
    if (read_file(key + ".spv", spv) && (dep.empty() || read_file(key + ".d", deps))) {
        if (write_atomic(out, spv) && (dep.empty() ||
                write_atomic(dep, replace_all(replace_all(deps, "@OUT@", out), "@SRCDIR@", dir)))) {
            return 0;
        }
    }

    // a miss: the real glslc, then its outputs into the cache (the .spv last: a .spv there has its .d beside it)
    const pid_t pid = fork();
    if (pid < 0) {
        run_real(argv);
    }
    if (pid == 0) {
        run_real(argv);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status)) {
        return 1;
    }
    if (WEXITSTATUS(status) == 0 && read_file(out, spv)) {
        if (dep.empty() || (read_file(dep, deps) &&
                write_atomic(key + ".d", replace_all(replace_all(deps, out, "@OUT@"), dir, "@SRCDIR@")))) {
            write_atomic(key + ".spv", spv);
        }
    }
    return WEXITSTATUS(status);
}
