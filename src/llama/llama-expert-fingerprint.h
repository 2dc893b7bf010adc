#pragma once

// The model fingerprint of a router trace (moe-subst; docs/expert-cache.md, "Router trace"): 64-bit FNV-1a over, for
// each MoE layer of the trunk (NextN/MTP layers excepted) in increasing order, the layer index; for each routed-expert
// weight tensor of the layer present, in the order ffn_gate_exps, ffn_up_exps, ffn_down_exps, ffn_gate_up_exps, its
// ne0, ne1, ne2 and ggml type; then the byte size of the router weights (ffn_gate_inp.weight) and their first
// LLAMA_EXPERT_FINGERPRINT_ROUTER_BYTES bytes as stored; every number a little-endian uint64. 0 means "none" and is
// never a fingerprint (a result of 0 becomes 1). The harness computes the same (harness.parsers.gguf_model.
// model_fingerprint), so that a trace recorded here is checked there, and the other way round.

#include <cstdint>
#include <string>

struct llama_model;

#define LLAMA_EXPERT_FINGERPRINT_ROUTER_BYTES 4096

// of a loaded model (the trace writer: header offset 40); 0 when it cannot be computed (a memory-fitting dry run,
// whose tensors have no data, or a MoE layer without a router)
uint64_t llama_expert_fingerprint_of_model(const llama_model & model);

// of a GGUF model file, read without loading it (llama-moe-sim --model); false and a one-line err when the file is
// not a readable GGUF model with routed experts
bool llama_expert_fingerprint_of_file(const std::string & path, uint64_t & fp, std::string & err);
