"""The run executor: runs a list of `RunSpec`s through a `Runner`, one JSON Lines record per finished run,
skipping runs already recorded (resume); what compare, sweep and topics share.

Ctrl-C stops the loop and keeps what finished. The records' fields are written by `harness.orchestration.serialise`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from harness.core import project
from harness.core.errors import HarnessError
from harness.core.records import Provenance, ResultsFile, make_record, utc_now
from harness.domain.plan import RunSpec
from harness.orchestration.serialise import bench_record, ppl_record
from harness.tools.cgroup import MemoryCgroup
from harness.tools.requests import Runner
from harness.tools.runners import ToolCrashedError

Progress = Callable[[int, int, str], None]  # (done, total, label of the run that starts or was skipped)


def no_progress(done: int, total: int, label: str) -> None:
    return None


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class Environment:
    """What `run_compare` needs from the outside world besides the runner; tests pass a fake."""

    def builds(self) -> dict[str, project.Build]:
        return {name: project.get_build(name) for name in ("stock", "patched")}

    def provenance(self, builds: dict[str, project.Build], argv: tuple[str, ...], gpu: str) -> Provenance:
        pin = project.read_pin()
        binaries = {f"{b.name}/{tool}": project.file_sha256(b.tool(tool), 16)
                    for b in builds.values() for tool in ("llama-bench", "llama-perplexity")}
        backend = ",".join(sorted({b.backend for b in builds.values()}))
        return Provenance(pin.name, pin.sha256, project.patch_series_hash(), binaries, backend, gpu, argv, utc_now())

    def gpu(self) -> str:
        from harness.tools.runners import gpu_name

        return gpu_name()

    def host_available_bytes(self) -> int:
        return int(psutil.virtual_memory().available)

    def default_threads(self) -> tuple[int, str]:
        """Threads for runs without --threads (no oversubscription), and how they were found."""
        from harness.tools.runners import default_threads

        return default_threads()

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def memory_cgroup(self, limit: int) -> MemoryCgroup:
        """compare --ram: a memory cgroup of `limit` bytes for the runs (CgroupError, one line, where none can be
        made); the caller removes it (`with`)."""
        return MemoryCgroup(limit, "moe-subst-compare")


class VulkanEnvironment(Environment):
    """`--backend vulkan`: the Vulkan builds (./build.sh --vulkan: stock-vulkan and patched-vulkan in
    build/builds.json), the device named by the build itself. Pair it with a ToolRunner whose extra_env has
    VULKAN_RUN_ENV, so that every run logs the device's own allocations (its peak is the budget's measurement)."""

    def builds(self) -> dict[str, project.Build]:
        from dataclasses import replace

        return {name: replace(project.get_build(f"{name}-vulkan"), name=name) for name in ("stock", "patched")}

    def gpu(self) -> str:
        from harness.tools.runners import vulkan_device

        return vulkan_device(self.builds()["patched"], VULKAN_RUN_ENV)


VULKAN_RUN_ENV = {"GGML_VK_MEMORY_LOGGER": "1"}  # ggml-vulkan logs every device allocation (the budget's measurement)


@dataclass(frozen=True)
class ExecOutcome:
    n_run: int
    n_resumed: int
    interrupted: bool
    notes: tuple[str, ...]


def execute_runs(specs: Sequence[RunSpec], runner: Runner, builds: dict[str, project.Build], prov: Provenance,
                 fp: str, results: ResultsFile, progress: Progress = no_progress,
                 meta: dict[str, Any] | None = None) -> ExecOutcome:
    """Run every spec whose key is not recorded yet, appending one record per finished run. Refuses a results
    file of another configuration (fingerprint). Ctrl-C stops the loop and keeps what finished. A patched
    build that rejects the speed runs' cache mode (no engine yet) skips the patched speed runs with a note."""
    existing = results.read()
    other = {r.get("fingerprint") for r in existing if r.get("kind") in ("ppl", "bench", "meta")} - {fp}
    if other:
        raise HarnessError(f"{results.path} holds results of a different configuration (model, budget, settings "
                           "or binaries changed): use a new --out directory, or delete the file to start over")
    notes: list[str] = []
    if results.drop_torn_tail():
        notes.append(f"dropped the torn last line of {results.path} (an interrupted write); its run is redone")
    if meta is not None and not any(r.get("kind") == "meta" for r in existing):
        results.append(make_record("meta", "meta", prov, {**meta, "fingerprint": fp}))
    done = {str(r["key"]) for r in existing}
    total = len(specs)
    n_resumed = n_run = 0
    interrupted = no_engine = False
    try:
        for i, spec in enumerate(specs):
            if spec.key in done:
                n_resumed += 1
                progress(i + 1, total, f"{spec.key} (recorded)")
                continue
            progress(i, total, spec.key)
            build = builds[spec.build]
            started = utc_now()
            if spec.kind == "ppl":
                assert spec.ppl is not None
                _fresh(spec.ppl.nll_dump)
                _fresh(Path(spec.ppl.cache.stats) if spec.ppl.cache and spec.ppl.cache.stats else None)
                data = ppl_record(spec, runner.perplexity(build, spec.ppl))
            else:
                assert spec.bench is not None
                if spec.build == "patched" and no_engine:
                    progress(i + 1, total, f"{spec.key} (skipped: no engine mode)")
                    continue
                _fresh(Path(spec.bench.cache.stats) if spec.bench.cache and spec.bench.cache.stats else None)
                try:
                    data = bench_record(spec, runner.bench(build, spec.bench))
                except ToolCrashedError as e:
                    mode = spec.bench.cache.mode if spec.bench.cache else ""
                    if mode and f"bad value '{mode}' for key 'mode'" in str(e):
                        no_engine = True
                        notes.append(f"the patched build has no '{mode}' mode (docs/expert-cache.md): the patched "
                                     "build's speed is not measured, only stock's")
                        progress(i + 1, total, f"{spec.key} (skipped: no {mode} mode)")
                        continue
                    raise
            data["fingerprint"] = fp
            results.append(make_record(spec.key, spec.kind, prov, data, started=started))
            n_run += 1
            progress(i + 1, total, spec.key + _peak_label(data))
    except KeyboardInterrupt:
        interrupted = True
    return ExecOutcome(n_run, n_resumed, interrupted, tuple(notes))


def _peak_label(data: dict[str, Any]) -> str:
    """compare --ram: ' (peak X MiB of the Y MiB limit)' after a run made in a memory cgroup."""
    peak, limit = data.get("peak_ram_bytes"), data.get("ram_limit_bytes")
    if limit is None:
        return ""
    return f" (peak {peak / 2**20:.0f} MiB of the {limit / 2**20:.0f} MiB limit)" if peak is not None else ""


def _fresh(path: Path | None) -> None:
    """Make room for an output file of the tool: its folder exists, no stale file from an earlier attempt."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
