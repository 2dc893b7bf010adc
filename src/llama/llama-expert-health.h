#pragma once

// The process's expert-cache health (moe-subst): the first failure that ended a compute for good (under host=file a
// model file changed in place, a failed read, a failed copy), kept for an application's health check: llama-server's
// /health answers 503 with it (patch 0007), where it said ok while every request failed (issue 35, item 8). A
// process holds one failure: once a cache's banks are not what its policy decided, every later decode of it fails,
// and a server that serves it is not healthy until it is started again.

#include <string>

// the first call's message is kept; later ones are ignored (thread-safe)
void llama_expert_health_fail(const std::string & why);

// "" while no expert cache of the process has failed; else the first failure's line
std::string llama_expert_health_failure();
