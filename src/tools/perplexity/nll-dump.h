#pragma once

// llama-perplexity --nll-dump FNAME (moe-subst): the exact NLL of every scored token, so that two runs on the
// same tokens can be compared pair by pair (harness/parsers reads it). Format, little-endian:
//   char    magic[8] = "LLNLLDMP"
//   uint32  version = 1, n_ctx, first (scored positions start here), n_chunk
//   uint64  count = n_chunk * (n_ctx - first - 1)
//   int32   token[count]   the predicted token
//   float64 nll[count]     its negative log-likelihood (natural log), chunk by chunk, in position order

#include "llama.h"

#include <string>
#include <vector>

// tokens and nll_history are indexed like perplexity's token vector: chunk c's scored position i is
// c*n_ctx + i for first <= i < n_ctx - 1 (the NLL of token c*n_ctx + i + 1)
bool nll_dump_write(const std::string & path, const std::vector<llama_token> & tokens,
        const std::vector<double> & nll_history, int n_ctx, int first, int n_chunk);
