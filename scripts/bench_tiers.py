#!/usr/bin/env python3
"""Expert tiers benchmark (issue 11): a MoE model bigger than the RAM its runs may use, decoded by stock llama.cpp
(experts paged in from the SSD through mmap) and by the engine reading missed experts from the model file
(`host=file`), all under the same RAM limit. Results, not tests.

How RAM is made scarce: a memory cgroup made for this benchmark alone, inside this process's own memory cgroup
(v1 or v2), whose limit counts the page cache (harness.tools.cgroup, which `harness compare --ram` uses too); each
run is one process started inside it; the cgroup is removed at the end, also on Ctrl-C. The limit is refused when
it exceeds MemAvailable minus a 2 GiB margin (a limit cannot starve the machine, but the runs inside it must not
either). Before each run the model file's pages are dropped from the page cache (posix_fadvise DONTNEED; clean
pages, no root needed), so that no run inherits another's cache.

Per run: decode tokens/s (llama-bench tg, mean and 95% CI over the rounds, interleaved), bytes read from storage
per generated token (the process's read_bytes, load excluded, from a run of 1 token), and for the engine its floor:
bytes read per token / the disk bandwidth this script measures (reads of one expert tensor's slice, the engine's
read size; measured before every round, the median used) plus the compute time with everything in RAM (stock
with the file in the page cache, no limit).

Usage: .venv/bin/python scripts/bench_tiers.py [--layers 5] [--ram 1600M] [--rounds 3] [--tokens 16]
       [--model FILE] [--slots 25%] [--out results/bench-tiers.json]
The default model (qwen3moe, the study's expert shape: 512 experts of 2048x512, top-10, Q4_0, 5 layers, 4.6 GB)
is generated once into results/ (about 6 minutes on 2 cores).

`--full-scale` (issue 23) is another benchmark: the study's whole geometry (48 layers) in an 8 GB budget, both stock
readaheads, floors from the engine's own read pattern, decode over distinct sequences, raw records under eval/,
each policy's delta-PPL beside its speed, optionally a trained model's routing replayed (`--full-scale --help`;
docs/expert-cache-engine.md "The full-scale benchmark"). `--full-scale --pack` adds, per policy, a row that reads
each missed expert in one read from the expert pack (written next to the model first when missing or stale) beside
the three-read row, a disk probe in its pattern, and the verdict of the rule harness.domain.tiers.pack_verdict
(target: one read >= 1.2x three reads where the disk is latency-bound, or the measured reason it is not).

The benchmark lives in the harness's layers: harness.orchestration.tiers_bench (this one) and tiers_full
(--full-scale), their pure parts in harness.domain.tiers; this script is their command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.orchestration.tiers_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], __doc__.split("\n")[0]))
