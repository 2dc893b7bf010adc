#pragma once

// Profile files (moe-subst): per-layer expert selection counts, the initial residency of a later run.

#include "llama-expert-policy.h"

#include <cstdint>
#include <string>
#include <vector>

// Profile files: per-layer expert selection counts, text, one line per layer:
//   moe-expert-profile 1
//   layer <il> <n_expert> <count_0> ... <count_{n_expert-1}>
bool llama_expert_profile_read(const std::string & path, std::vector<std::vector<uint64_t>> & counts, std::string & err);
bool llama_expert_profile_write(const std::string & path, const std::vector<const llama_expert_layer_policy *> & layers,
                                const std::vector<int32_t> & layer_ids);
