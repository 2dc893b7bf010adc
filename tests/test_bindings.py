"""llama-cpp-python on the patched libllama (issue 12, item 4), on the trained model, against the patched llama-cli.

The bindings are the pinned sdist's Python package (`./build.sh --bindings`, seconds: no C++ build) pointed at the
patched build by LLAMA_CPP_LIB_PATH (harness.tools.bindings). With the same LLAMA_MOE_CACHE spec, prompt and
greedy sampling, `llama_cpp.Llama` generates llama-cli's text, and the counters it reads through
`llama_expert_cache_metrics()` (harness.tools.bindings.cache_metrics: llama-server's /metrics rows) equal the
ones llama-cli's stats file records. llama-cli applies a chat template: a template that renders the message
as it is makes its prompt the raw text that `Llama.create_completion` gets. llama-cli (llama-server's context)
decodes two tokens of id 0 before the prompt, to probe the memory (common_context_can_seq_rm); patch 0007 restarts
the cache after it (llama_perf_context_reset), so both sides start from the configured residency with zero counters.

Skipped, with the reason, when llama_cpp is not installed in the interpreter that runs the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.project import Build, project_root
from harness.parsers.cache_stats import ENGINE_COUNTERS, POLICY_COUNTERS
from harness.tools.bindings import bindings_env, installed_bindings

ROOT = project_root()
MODEL = ROOT / "models" / "tinymoe-f16.gguf"
PROMPT = "Once upon a time"
N_PREDICT = 24
SEED = 7
RAW_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"

# the Python side: greedy completion, the counters through the harness API
SCRIPT = """
import json, sys
import llama_cpp
from llama_cpp import Llama
from harness.tools.bindings import cache_metrics, cache_props

model, prompt, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=model, n_ctx=512, n_threads=2, seed=seed, verbose=False)
r = llm.create_completion(prompt, temperature=0.0, max_tokens=n, seed=seed)
m = cache_metrics(llm)
print(json.dumps({"lib": str(llama_cpp.llama_cpp._lib._name), "text": r["choices"][0]["text"],
                  "n": r["usage"]["completion_tokens"], "counters": m.counters if m else None,
                  "slots": m.slots if m else None, "bank_bytes": m.bank_bytes if m else None,
                  "props": cache_props(llm)}))
"""


@pytest.fixture(scope="module")
def bindings() -> Path:
    where = installed_bindings()
    if where is None:
        pytest.skip(f"llama-cpp-python is not installed for {sys.executable}: ./build.sh --bindings (seconds: "
                    "the pinned sdist's Python package, no C++ build)")
    return where


def _python(build: Build, spec: str | None, tmp: Path) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}
    env.update(bindings_env(build))
    env["PYTHONPATH"] = str(ROOT)
    if spec is not None:
        env["LLAMA_MOE_CACHE"] = spec
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(MODEL), PROMPT, str(N_PREDICT), str(SEED)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict = json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[type-arg]
    return out


def _cli(build: Build, spec: str, tmp: Path) -> str:
    """The text llama-cli generates (between its echo of the prompt and its speed line)."""
    template = tmp / "raw.jinja"
    template.write_text(RAW_TEMPLATE)
    env = {**{k: v for k, v in os.environ.items() if k != "LLAMA_MOE_CACHE"}, "LLAMA_MOE_CACHE": spec}
    res = subprocess.run([str(build.tool("llama-cli")), "-m", str(MODEL), "-p", PROMPT, "-n", str(N_PREDICT), "-st",
                          "-t", "2", "--temp", "0", "--seed", str(SEED), "--chat-template-file", str(template)],
                         capture_output=True, text=True, env=env, timeout=300, stdin=subprocess.DEVNULL, cwd=tmp)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    head, sep, rest = res.stdout.partition(f"> {PROMPT}\n")
    assert sep, res.stdout[-3000:]
    text, sep, _ = rest.partition("\n[ Prompt:")
    assert sep, res.stdout[-3000:]
    return text


@pytest.mark.build
@pytest.mark.parametrize("mode", ["emulate", "engine"])
def test_llama_cpp_python_equals_llama_cli(mode: str, tmp_path: Path, bindings: Path, patched_build: Build) -> None:
    if not MODEL.is_file():
        pytest.skip(f"{MODEL} is missing")
    spec = f"mode={mode},policy=quality,slots=25%"
    cli_stats = tmp_path / "cli-stats.json"
    py_stats = tmp_path / "py-stats.json"
    cli_text = _cli(patched_build, f"{spec},stats={cli_stats}", tmp_path)
    py = _python(patched_build, f"{spec},stats={py_stats}", tmp_path)
    assert py["lib"] == str(patched_build.bin_dir / "libllama.so")
    assert py["n"] == N_PREDICT
    assert py["text"].rstrip("\n") == cli_text.rstrip("\n") and len(py["text"].strip()) > 0

    cli = json.loads(cli_stats.read_text())
    own = json.loads(py_stats.read_text())  # the same context's stats file: the API and the file agree
    counters = py["counters"]
    assert counters is not None
    for k in POLICY_COUNTERS:
        assert counters[k] == cli["total"][k] == own["total"][k], k
    assert counters["calls"] > 0 and counters["misses"] > 0 and counters["substitutions"] > 0
    assert py["slots"] == cli["config"]["slots"]
    assert py["props"]["mode"] == mode and py["props"]["n_slots"] == py["slots"]
    if mode == "engine":
        for k in ENGINE_COUNTERS:
            if not k.endswith("_ns"):  # times differ from run to run
                assert counters[k] == cli["engine"][k] == own["engine"][k], k
        assert counters["copied_experts"] > 0
        assert py["bank_bytes"] == cli["engine"]["bank_bytes"] > 0


@pytest.mark.build
def test_llama_cpp_python_without_a_cache(tmp_path: Path, bindings: Path, patched_build: Build) -> None:
    """LLAMA_MOE_CACHE unset: the patched library runs with no cache, and the API says so (None)."""
    if not MODEL.is_file():
        pytest.skip(f"{MODEL} is missing")
    py = _python(patched_build, None, tmp_path)
    assert py["counters"] is None and py["props"] is None and py["n"] == N_PREDICT


@pytest.mark.build
def test_the_generation_worker_honours_llama_arg_repack(bindings: Path, patched_build: Build, tmp_path: Path) -> None:
    """LLAMA_ARG_REPACK=0 (llama.cpp's environment form of --no-repack) reaches the models the generation worker
    loads (harness.tools.genworker): llama-cpp-python has no option for it, and a CPU whose repack kernels fail
    (this VM on Q8_0) needs it."""
    script = ("import llama_cpp.llama_cpp as lib\n"
              "from harness.tools.genworker import _no_repack\n"
              "before = lib.llama_model_default_params().use_extra_bufts\n"
              "_no_repack()\n"
              "print(before, lib.llama_model_default_params().use_extra_bufts)\n")
    env = {**os.environ, **bindings_env(patched_build), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True", "False"]
