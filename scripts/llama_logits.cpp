// llama_logits: a small probe over the stock libllama, for checking the tiny MoE export.
//
//   llama_logits tokenize MODEL TEXT_FILE OUT_IDS
//       tokenises the whole file the way llama-perplexity does (add_special = true, parse_special =
//       false) and writes the token ids as little-endian int32 to OUT_IDS.
//   llama_logits logits MODEL IDS_FILE N_CTX OUT_LOGITS
//       reads int32 token ids, evaluates consecutive windows of N_CTX tokens (each window in a fresh
//       sequence, positions 0..N_CTX-1) and writes the logits of every position as float32
//       [n_windows * N_CTX, n_vocab] to OUT_LOGITS. An optional last argument "f32" keeps the KV cache
//       in F32 and turns flash attention off (the defaults, also llama-perplexity's, are an F16 cache
//       and flash attention "auto").
//
// Build (after ./build.sh): see scripts/build_llama_logits.sh.

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

static int usage() {
    fprintf(stderr, "usage: llama_logits tokenize MODEL TEXT_FILE OUT_IDS\n"
                    "       llama_logits logits MODEL IDS_FILE N_CTX OUT_LOGITS [f32]\n");
    return 2;
}

static void quiet_log(enum ggml_log_level level, const char * text, void * /*user*/) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        return usage();
    }
    const std::string mode = argv[1];
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[2], mparams);
    if (model == nullptr) {
        fprintf(stderr, "failed to load %s\n", argv[2]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    if (mode == "tokenize") {
        std::ifstream in(argv[3], std::ios::binary);
        std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        std::vector<llama_token> ids(text.size() + 16);
        int32_t n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(),
                                   true, false);
        if (n < 0) {
            fprintf(stderr, "tokenize failed (%d)\n", n);
            return 1;
        }
        FILE * f = fopen(argv[4], "wb");
        fwrite(ids.data(), sizeof(int32_t), (size_t) n, f);
        fclose(f);
        fprintf(stderr, "%d tokens\n", n);
    } else if (mode == "logits") {
        if (argc < 6) {
            return usage();
        }
        const int n_ctx = atoi(argv[4]);
        std::ifstream in(argv[3], std::ios::binary);
        std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        std::vector<llama_token> ids(raw.size() / sizeof(int32_t));
        memcpy(ids.data(), raw.data(), ids.size() * sizeof(int32_t));
        const int n_win = (int) ids.size() / n_ctx;

        llama_context_params cparams = llama_context_default_params();
        cparams.n_ctx    = n_ctx;
        cparams.n_batch  = n_ctx;
        cparams.n_ubatch = n_ctx;
        cparams.n_seq_max = 1;
        if (argc > 6 && std::string(argv[6]) == "f32") {
            cparams.type_k = GGML_TYPE_F32;
            cparams.type_v = GGML_TYPE_F32;
            cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
        }
        llama_context * ctx = llama_init_from_model(model, cparams);
        if (ctx == nullptr) {
            fprintf(stderr, "failed to create context\n");
            return 1;
        }
        const int n_vocab = llama_vocab_n_tokens(vocab);
        FILE * f = fopen(argv[5], "wb");
        llama_batch batch = llama_batch_init(n_ctx, 0, 1);
        for (int w = 0; w < n_win; ++w) {
            llama_memory_clear(llama_get_memory(ctx), true);
            batch.n_tokens = n_ctx;
            for (int i = 0; i < n_ctx; ++i) {
                batch.token[i]     = ids[(size_t) w * n_ctx + i];
                batch.pos[i]       = i;
                batch.n_seq_id[i]  = 1;
                batch.seq_id[i][0] = 0;
                batch.logits[i]    = 1;
            }
            if (llama_decode(ctx, batch) != 0) {
                fprintf(stderr, "decode failed\n");
                return 1;
            }
            for (int i = 0; i < n_ctx; ++i) {
                fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t) n_vocab, f);
            }
        }
        fclose(f);
        llama_batch_free(batch);
        llama_free(ctx);
        fprintf(stderr, "%d windows of %d tokens, n_vocab %d\n", n_win, n_ctx, n_vocab);
    } else {
        return usage();
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
