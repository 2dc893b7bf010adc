"""moe-subst harness: build-aware runners, parsers, statistics and reports for the expert cache.

Layers, top to bottom; a module imports only from its own layer and the layers below it, and no modules
import each other in a circle (tests/test_layers.py checks both):

- `cli`: the `harness` command, an argparse adapter (parse, call one function, render); `cli.options` holds the
  options that several commands share.
- `orchestration`: the commands: compare (its `planner`, run `executor`, `serialise`r of records and options,
  `summary` statistics), sweep, frontier, topics, study, check, simulate, doctor, bpb, `pack` (the expert pack's
  writer and its full check), `rerender` (`harness report`), and the tiers benchmark behind scripts/bench_tiers.py
  (`tiers_bench`, `tiers_full`).
  They run tools, summarise and write report.md through the report layer.
- `report`: renderers, pure functions of results: terminal tables, markdown, simulate's tables, plots.
- `domain`: what the layers hand each other: the policy `catalogue`, the perplexity `settings`, options,
  `plan`s (and the one residency -> slots rule, `plan.slots_for_residency`) and `results` of the commands, the cost
  model, the tiers benchmark's floors, sequences and records (`tiers`), the expert pack's layout and header
  (`pack`). Frozen dataclasses and pure rules: nothing
  it imports starts a process or a thread (tests/test_layers.py).
- `tools`: the outside world: `runners` of the built llama.cpp tools (the only place that starts them, with
  `chunked`: llama-perplexity timed chunk by chunk for the tiers benchmark) and the value types they take and return
  (`requests`: the cache spec, placements, requests, run outputs; pure), host probes (`cgroup`, `readahead`: a block
  device's read_ahead_kb, set and restored; `diskbw`: the disk in the engine's read pattern), generated test models
  (`synth`: the writer; `synth_layouts`: the architectures, their tensors and metadata; `synth_tokenizer`: the
  tokenizer trainer and test text), datasets.
- `parsers`: the text and binary formats, into frozen dataclasses: what the tools write (perplexity,
  llama-bench, memory breakdown, the cache's budget plan line, cache statistics, llama-moe-sim's output, router
  traces, NLL dumps), GGUF metadata (and a vocabulary's bytes per token, `vocab`), and check's baseline file.
- `stats`: pure statistics of numbers: intervals, paired deltas, correlation, the Pareto frontier, bits per byte.
- `core`: the error type, sizes, where things are (project root, pin, builds), JSON Lines records.

The issue behind this order listed report below stats; here report sits above domain (and so above tools,
parsers and stats) because its renderers take the commands' results, which hold statistics and parsed
records, and below orchestration because the commands write their report.md. `profiles/` is packaged data
(hardware profiles of the cost model).
"""

__version__ = "0.1.0"
