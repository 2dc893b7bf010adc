/*
 * A measurement aid for the *stock* llama.cpp tools, loaded with LD_PRELOAD by the harness and the tests.
 *
 * llama.cpp's common logger prints from a worker thread and is never drained at exit (upstream issue
 * ggml-org/llama.cpp#22142), so a short run often exits before its last lines (llama-perplexity's
 * "Final estimate", the memory breakdown) are printed: 9 of 20 runs here. This library's destructor,
 * which runs at exit before stdio is closed, pauses the logger, which drains its queue. It changes no
 * computation and does nothing in a process without llama.cpp's common library. The patched build
 * drains the log itself (patch "log: drain the log queue at exit").
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

struct common_log;

__attribute__((destructor)) static void moe_subst_drain_common_log(void) {
    struct common_log * (*log_main)(void) = (struct common_log * (*)(void)) dlsym(RTLD_DEFAULT, "_Z15common_log_mainv");
    void (*log_pause)(struct common_log *) = (void (*)(struct common_log *)) dlsym(RTLD_DEFAULT, "_Z16common_log_pauseP10common_log");
    if (log_main != NULL && log_pause != NULL) {
        log_pause(log_main());
    }
}
