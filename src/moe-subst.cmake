# moe-subst: compile the expert cache (the C++ of this repository's src/) into the patched llama.cpp targets.
#
# The patched tree's top-level CMakeLists.txt includes this file at its end (patch "cmake: compile
# moe-subst's sources"), once every upstream target exists; build.sh passes -DMOE_SUBST_SOURCE_DIR=<repo>/src.
# Upstream files get call sites only; their includes of our headers are set per source file, so that every
# other object keeps the stock command line (and ccache shares it with the stock build).

set(MOE_SUBST_SRC "${CMAKE_CURRENT_LIST_DIR}")

# The model-free rooms: the spec and its keys, the miss rules, the residency policy and profiles, the budget, the
# machine's memory facts, --moe-cache auto's decision and the tuned profile it reads (with its JSON reader). They
# need neither ggml nor a model: the C++ unit tests, the sanitizer tests and llama-moe-sim compile this list
# (tests/conftest.py reads it from here, the one place it is written).
set(MOE_SUBST_POLICY_SOURCES
    ${MOE_SUBST_SRC}/llama/llama-expert-spec.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-spec-json.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-rules.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-policy.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-profile.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-budget.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-machine.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-auto.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-json.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-tuned.cpp)

# libllama: the model-free rooms, the engine's rooms (model-file reads, copiers, banks), the cache's rooms
# (construction and hooks, the route step, the trace, the statistics) and the C API for applications
# (include/llama-expert-cache-api.h)
set(MOE_SUBST_LLAMA_SOURCES
    ${MOE_SUBST_POLICY_SOURCES}
    ${MOE_SUBST_SRC}/llama/llama-expert-io.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-mapping.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-resident.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-pack.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-copier.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-measure.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-engine.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-cache.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-route.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-shadow.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-trace.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-replay.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-fingerprint.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-report.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-writer.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-health.cpp
    ${MOE_SUBST_SRC}/llama/llama-expert-cache-api.cpp)
target_sources(llama PRIVATE ${MOE_SUBST_LLAMA_SOURCES})
set_source_files_properties(
    ${MOE_SUBST_LLAMA_SOURCES}
    ${PROJECT_SOURCE_DIR}/src/llama.cpp
    ${PROJECT_SOURCE_DIR}/src/llama-context.cpp
    ${PROJECT_SOURCE_DIR}/src/llama-graph.cpp
    TARGET_DIRECTORY llama
    PROPERTIES INCLUDE_DIRECTORIES "${MOE_SUBST_SRC}/llama;${MOE_SUBST_SRC}/include")

# llama-perplexity: the --nll-dump writer
if (TARGET llama-perplexity-impl)
    target_sources(llama-perplexity-impl PRIVATE ${MOE_SUBST_SRC}/tools/perplexity/nll-dump.cpp)
    set_source_files_properties(
        ${MOE_SUBST_SRC}/tools/perplexity/nll-dump.cpp
        ${PROJECT_SOURCE_DIR}/tools/perplexity/perplexity.cpp
        TARGET_DIRECTORY llama-perplexity-impl
        PROPERTIES INCLUDE_DIRECTORIES "${MOE_SUBST_SRC}/tools/perplexity")
endif()

# llama-server: /metrics and /props rows come from the C API
if (TARGET server-context)
    set_source_files_properties(
        ${PROJECT_SOURCE_DIR}/tools/server/server-context.cpp
        TARGET_DIRECTORY server-context
        PROPERTIES INCLUDE_DIRECTORIES "${MOE_SUBST_SRC}/include")
endif()

# llama-server: its first termination signal has the cache's files written (a shutdown under load hangs upstream)
if (TARGET llama-server-impl)
    set_source_files_properties(
        ${PROJECT_SOURCE_DIR}/tools/server/server.cpp
        TARGET_DIRECTORY llama-server-impl
        PROPERTIES INCLUDE_DIRECTORIES "${MOE_SUBST_SRC}/include")
endif()

# llama-moe-sim: replays a router trace under any policy with the engine's own policy code
if (LLAMA_BUILD_TOOLS AND TARGET llama-common)
    add_executable(llama-moe-sim ${MOE_SUBST_SRC}/tools/moe-sim/moe-sim.cpp)
    target_include_directories(llama-moe-sim PRIVATE
        ${PROJECT_SOURCE_DIR}/src ${MOE_SUBST_SRC}/llama ${MOE_SUBST_SRC}/include)
    target_link_libraries(llama-moe-sim PRIVATE llama ${CMAKE_THREAD_LIBS_INIT})
    target_compile_features(llama-moe-sim PRIVATE cxx_std_17)
    if (LLAMA_TOOLS_INSTALL)
        install(TARGETS llama-moe-sim RUNTIME)
    endif()
endif()
