#pragma once

// The expert cache's files written during a run (moe-subst): the stats= and profile_out= files of every live cache,
// written on request by a thread of their own, so that a process that never reaches its end keeps them. llama-server
// asks on the first SIGTERM or SIGINT (patches/0010), because under load it then never exits (upstream's shutdown
// waits for the HTTP requests in flight, which wait for a decode loop that has stopped; its second signal calls
// exit(1), past every destructor): the files a cache writes when it is destroyed would be lost.

#include <functional>
#include <string>

struct llama_expert_cache_impl;

// a cache whose files the writer thread writes on request (the first one starts the thread); removed before the cache
// is destroyed (waits for a write of its files in progress)
void llama_expert_writer_add(llama_expert_cache_impl * cache);
void llama_expert_writer_remove(llama_expert_cache_impl * cache);

// async-signal-safe (one write(2) to a pipe, errno kept): the writer thread writes every live cache's files now
// (llama_expert_cache_impl::write_files_now); returns at once; nothing when no cache with files lives
void llama_expert_writer_request();

// write(path') to a temporary file next to path and rename it over path, so that a reader, or a kill during the
// write, never finds half a file; a path that exists and is not a regular file (a standard stream) is written
// directly. False when write or the rename failed (errno set), with no temporary file left.
bool llama_expert_write_replacing(const std::string & path, const std::function<bool(const std::string &)> & write);
