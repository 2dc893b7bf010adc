#include "llama-expert-json.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace {

const int JSON_MAX_DEPTH = 64;

struct json_reader {
    const std::string & s;
    size_t      pos = 0;
    std::string err;

    explicit json_reader(const std::string & text) : s(text) {}

    bool fail(const std::string & what) {
        if (err.empty()) {
            err = what + " at offset " + std::to_string(pos);
        }
        return false;
    }

    void skip_ws() {
        while (pos < s.size() && (s[pos] == ' ' || s[pos] == '\t' || s[pos] == '\n' || s[pos] == '\r')) {
            pos++;
        }
    }

    bool literal(const char * word, size_t n) {
        if (s.compare(pos, n, word) != 0) {
            return fail("unexpected character");
        }
        pos += n;
        return true;
    }

    static void put_utf8(std::string & out, uint32_t cp) {
        if (cp < 0x80) {
            out += (char) cp;
        } else if (cp < 0x800) {
            out += (char) (0xC0 | (cp >> 6));
            out += (char) (0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            out += (char) (0xE0 | (cp >> 12));
            out += (char) (0x80 | ((cp >> 6) & 0x3F));
            out += (char) (0x80 | (cp & 0x3F));
        } else {
            out += (char) (0xF0 | (cp >> 18));
            out += (char) (0x80 | ((cp >> 12) & 0x3F));
            out += (char) (0x80 | ((cp >> 6) & 0x3F));
            out += (char) (0x80 | (cp & 0x3F));
        }
    }

    bool hex4(uint32_t & v) {
        if (pos + 4 > s.size()) {
            return fail("a short \\u escape");
        }
        v = 0;
        for (int i = 0; i < 4; ++i) {
            const char c = s[pos++];
            v <<= 4;
            if (c >= '0' && c <= '9') {
                v |= (uint32_t) (c - '0');
            } else if (c >= 'a' && c <= 'f') {
                v |= (uint32_t) (c - 'a' + 10);
            } else if (c >= 'A' && c <= 'F') {
                v |= (uint32_t) (c - 'A' + 10);
            } else {
                return fail("a bad \\u escape");
            }
        }
        return true;
    }

    bool string(std::string & out) {
        pos++; // the opening quote
        out.clear();
        while (pos < s.size()) {
            const unsigned char c = (unsigned char) s[pos];
            if (c == '"') {
                pos++;
                return true;
            }
            if (c < 0x20) {
                return fail("a control character in a string");
            }
            if (c != '\\') {
                out += (char) c;
                pos++;
                continue;
            }
            if (++pos >= s.size()) {
                break;
            }
            const char e = s[pos++];
            switch (e) {
                case '"':  out += '"';  break;
                case '\\': out += '\\'; break;
                case '/':  out += '/';  break;
                case 'b':  out += '\b'; break;
                case 'f':  out += '\f'; break;
                case 'n':  out += '\n'; break;
                case 'r':  out += '\r'; break;
                case 't':  out += '\t'; break;
                case 'u': {
                    uint32_t cp = 0;
                    if (!hex4(cp)) {
                        return false;
                    }
                    if (cp >= 0xD800 && cp < 0xDC00 && s.compare(pos, 2, "\\u") == 0) {
                        const size_t back = pos;
                        pos += 2;
                        uint32_t lo = 0;
                        if (!hex4(lo)) {
                            return false;
                        }
                        if (lo >= 0xDC00 && lo < 0xE000) {
                            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                        } else {
                            pos = back; // a lone high surrogate, then another escape
                        }
                    }
                    put_utf8(out, cp); // a lone surrogate as its code point, as Python's json keeps it
                    break;
                }
                default:
                    pos--;
                    return fail("a bad escape in a string");
            }
        }
        return fail("an unterminated string");
    }

    bool number(llama_expert_json & v) {
        const size_t b = pos;
        bool integer = true;
        if (s[pos] == '-') {
            pos++;
        }
        auto digits = [&]() {
            const size_t d = pos;
            while (pos < s.size() && s[pos] >= '0' && s[pos] <= '9') {
                pos++;
            }
            return pos - d;
        };
        if (pos < s.size() && s[pos] == '0') {
            pos++;
        } else if (digits() == 0) {
            return fail("a bad number");
        }
        if (pos < s.size() && s[pos] == '.') {
            integer = false;
            pos++;
            if (digits() == 0) {
                return fail("a bad number");
            }
        }
        if (pos < s.size() && (s[pos] == 'e' || s[pos] == 'E')) {
            integer = false;
            pos++;
            if (pos < s.size() && (s[pos] == '+' || s[pos] == '-')) {
                pos++;
            }
            if (digits() == 0) {
                return fail("a bad number");
            }
        }
        const std::string text = s.substr(b, pos - b);
        errno = 0;
        v.kind    = llama_expert_json::NUMBER;
        v.number  = std::strtod(text.c_str(), nullptr);
        v.integer = integer;
        if (!std::isfinite(v.number)) {
            pos = b;
            return fail("a number out of range");
        }
        return true;
    }

    bool value(llama_expert_json & v, int depth) {
        skip_ws();
        if (pos >= s.size()) {
            return fail("unexpected end");
        }
        if (depth > JSON_MAX_DEPTH) {
            return fail("nesting deeper than 64");
        }
        const char c = s[pos];
        if (c == '{') {
            v.kind = llama_expert_json::OBJECT;
            pos++;
            skip_ws();
            if (pos < s.size() && s[pos] == '}') {
                pos++;
                return true;
            }
            while (true) {
                skip_ws();
                if (pos >= s.size() || s[pos] != '"') {
                    return fail("expected a member name");
                }
                std::string name;
                if (!string(name)) {
                    return false;
                }
                skip_ws();
                if (pos >= s.size() || s[pos] != ':') {
                    return fail("expected ':'");
                }
                pos++;
                llama_expert_json m;
                if (!value(m, depth + 1)) {
                    return false;
                }
                v.members[name] = std::move(m);
                skip_ws();
                if (pos < s.size() && s[pos] == ',') {
                    pos++;
                    continue;
                }
                if (pos < s.size() && s[pos] == '}') {
                    pos++;
                    return true;
                }
                return fail("expected ',' or '}'");
            }
        }
        if (c == '[') {
            v.kind = llama_expert_json::ARRAY;
            pos++;
            skip_ws();
            if (pos < s.size() && s[pos] == ']') {
                pos++;
                return true;
            }
            while (true) {
                llama_expert_json item;
                if (!value(item, depth + 1)) {
                    return false;
                }
                v.items.push_back(std::move(item));
                skip_ws();
                if (pos < s.size() && s[pos] == ',') {
                    pos++;
                    continue;
                }
                if (pos < s.size() && s[pos] == ']') {
                    pos++;
                    return true;
                }
                return fail("expected ',' or ']'");
            }
        }
        if (c == '"') {
            v.kind = llama_expert_json::STRING;
            return string(v.str);
        }
        if (c == 't') {
            v.kind = llama_expert_json::BOOL;
            v.boolean = true;
            return literal("true", 4);
        }
        if (c == 'f') {
            v.kind = llama_expert_json::BOOL;
            return literal("false", 5);
        }
        if (c == 'n') {
            v.kind = llama_expert_json::NUL;
            return literal("null", 4);
        }
        if (c == '-' || (c >= '0' && c <= '9')) {
            return number(v);
        }
        return fail("unexpected character");
    }
};

} // namespace

const llama_expert_json * llama_expert_json::get(const std::string & name) const {
    if (kind != OBJECT) {
        return nullptr;
    }
    const auto it = members.find(name);
    return it == members.end() ? nullptr : &it->second;
}

bool llama_expert_json::parse(const std::string & text, llama_expert_json & out, std::string & err) {
    json_reader r(text);
    out = llama_expert_json();
    if (!r.value(out, 0)) {
        err = r.err;
        return false;
    }
    r.skip_ws();
    if (r.pos != text.size()) {
        r.fail("extra data after the value");
        err = r.err;
        return false;
    }
    return true;
}
