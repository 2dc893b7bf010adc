#pragma once

// A small JSON reader (RFC 8259) for the files the cache reads that the harness writes as JSON: the tuned profile
// (llama-expert-tuned.h). libllama has no JSON library (upstream's vendored nlohmann/json is for common/ and the
// tools), and the model-free rooms must build alone (the C++ unit tests), so this is ours: a value tree, strict
// grammar (no NaN, no trailing commas, no comments), nesting at most 64 deep, every error one line with its offset.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

struct llama_expert_json {
    enum kind_t { NUL, BOOL, NUMBER, STRING, ARRAY, OBJECT };

    kind_t      kind    = NUL;
    bool        boolean = false;
    double      number  = 0.0;
    bool        integer = false; // a NUMBER written without fraction or exponent
    std::string str;
    std::vector<llama_expert_json>            items;   // ARRAY
    std::map<std::string, llama_expert_json>  members; // OBJECT (a repeated name: the last one, as Python's json)

    // the member `name` of an object; nullptr when this is not an object or has no such member
    const llama_expert_json * get(const std::string & name) const;

    // the whole text as one value; false and a one-line err ("... at offset N") when it is not JSON
    static bool parse(const std::string & text, llama_expert_json & out, std::string & err);
};
