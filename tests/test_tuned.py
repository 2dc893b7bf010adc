"""The tuned profile's reader in `--moe-cache auto` (docs/expert-cache.md, "Tuned profile"; issue 24).

- the C++ reader (src/llama/llama-expert-tuned.cpp, through tests/cpp/tuned_read.cpp) and the Python reference
  (harness.domain.tune.auto_policy: parse_tune_profile, check_profile_model, tuned_policy) give the same policy and the
  same reason on the same cases: the choice by slots, another model (size, fingerprint), another schema or version,
  not JSON, every kind of damage the reference names (each field of the model, machine and choice entries removed in
  turn); the locations and their order (the cache folder's keyed by the model's fingerprint: two models of one file
  name keep two profiles); the policy keys' table;
- with the real build: a profile written by harness's own writer next to a generated model bigger than a (fake)
  memory limit makes auto run its policy (the plan line, the stats' config); one of another model, another size,
  another schema_version or not JSON is not used, the line says why and auto runs quality; the user's policy wins;
  the cache folder is the second place (keyed by the fingerprint), its name-only path the third; a FIFO in the first
  place is not opened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from harness.core.project import Build
from harness.domain.tune import (
    POLICY_KEYS,
    MachineFacts,
    ModelIdentity,
    SpeedCheck,
    TuneChoice,
    TuneProfile,
    auto_policy,
    profile_locations,
    profile_to_json,
    tune_cache_dir,
)
from harness.parsers.gguf_model import model_fingerprint
from harness.tools.synth import SynthSpec, write_synth_model

ROOT = Path(__file__).resolve().parents[1]
OUR_SRC = ROOT / "src"
MiB = 2**20

IDENTITY = ModelIdentity("m", "m.gguf", 1234, "00000000deadbeef", 16, 2, 4)
FACTS = MachineFacts(cpus=2, mem_total=24 << 30, mem_available=16 << 30, gpus=(), disk_path="/m.gguf",
                     disk_expert_bytes=3 << 20, disk_read_bytes=1 << 20, disk_readers=4, disk_direct=True,
                     disk_expert_us=2000.0, disk_gbs=1.5, host_copy_gbs=8.0, compute_ms_per_token=10.0)
TUNED = "rule=zero,tau=0.3,evict=lfu,admit=off,prefetch=off"
WIDE = "rule=threshold,tau=0.1,evict=lru,admit=0.5,prefetch=off"


def _profile(identity: ModelIdentity = IDENTITY, slots: tuple[int, int] = (4, 2)) -> TuneProfile:
    choice = TuneChoice("25%", 0.25, slots[0], 16, TUNED, "mode=engine,slots=4,...", 0.75, 0.46, 1.06, 120.0, 80.0,
                        100.0)
    other = replace(choice, residency="12.5%", fraction=0.125, slots=slots[1], policy=WIDE, delta_pct=-0.004,
                    ci_low=-1.5, ci_high=2.25)
    return TuneProfile(identity, 1.0, "point estimate", "file", FACTS, {"name": "tuned"}, (choice, other),
                       "/t.txt", 512, 32, "2026-12-02T00:00:00+00:00", {"pin": "x"})


@pytest.fixture(scope="module")
def tuned_read(tmp_path_factory: pytest.TempPathFactory, policy_sources: list[Path]) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("tuned") / "tuned_read"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{OUR_SRC / 'llama'}", f"-I{OUR_SRC / 'include'}",
                    str(ROOT / "tests" / "cpp" / "tuned_read.cpp"), *map(str, policy_sources), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    return exe


def _cpp(exe: Path, *args: str) -> str:
    res = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _delete(d: dict[str, Any], path: str) -> dict[str, Any]:
    cur: Any = d
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur[k]
    del cur[int(keys[-1]) if keys[-1].isdigit() else keys[-1]]
    return d


def _set(d: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    cur: Any = d
    keys = path.split(".")
    for k in keys[:-1]:
        cur = cur[int(k)] if k.isdigit() else cur[k]
    cur[int(keys[-1]) if keys[-1].isdigit() else keys[-1]] = value
    return d


def _cases() -> list[tuple[str, str | None, int, ModelIdentity]]:
    """(name, the profile's text or None for none found, the slots planned, the model)."""
    good = profile_to_json(_profile())
    base = json.loads(good)
    cases: list[tuple[str, str | None, int, ModelIdentity]] = [
        ("none", None, 4, IDENTITY),
        ("at 4", good, 4, IDENTITY), ("at 3", good, 3, IDENTITY), ("at 2", good, 2, IDENTITY),
        ("at 1", good, 1, IDENTITY), ("at 100", good, 100, IDENTITY),
        ("equal slots: the first", profile_to_json(_profile(slots=(3, 3))), 3, IDENTITY),
        ("another size", good, 4, replace(IDENTITY, file_bytes=1235)),
        ("another fingerprint", good, 4, replace(IDENTITY, fingerprint="00000000deadbeee")),
        ("a fingerprint in capitals", good, 4, replace(IDENTITY, fingerprint="00000000DEADBEEF")),
        ("file_bytes as text", json.dumps(_set(json.loads(good), "model.file_bytes", "1234")), 4, IDENTITY),
        ("schema_version 2", json.dumps(_set(json.loads(good), "schema_version", 2)), 4, IDENTITY),
        ("schema_version '1'", json.dumps(_set(json.loads(good), "schema_version", "1")), 4, IDENTITY),
        ("schema_version 1.0", json.dumps(_set(json.loads(good), "schema_version", 1.0)), 4, IDENTITY),
        ("no schema_version", json.dumps(_delete(json.loads(good), "schema_version")), 4, IDENTITY),
        ("another schema", json.dumps(_set(json.loads(good), "schema", "other")), 4, IDENTITY),
        ("a list", "[1, 2]", 4, IDENTITY),
        ("not JSON", "{", 4, IDENTITY), ("empty", "", 4, IDENTITY), ("cut short", good[: len(good) // 2], 4, IDENTITY),
        ("extra data", good + "x", 4, IDENTITY), ("a trailing comma", good.replace("}\n", ",}\n", 1), 4, IDENTITY),
        ("unknown keys", json.dumps({**base, "later": {"x": [1, 2.5e3, None, True]},
                                     "choices": [{**c, "new": "\\u00e9"} for c in base["choices"]]}), 4, IDENTITY),
        ("escapes", json.dumps(_set(json.loads(good), "choices.0.residency", "25\u00e9% \"q\" \U0001f600")), 4,
         IDENTITY),
        ("no created", json.dumps(_delete(json.loads(good), "created")), 4, IDENTITY),
        ("choices empty", json.dumps(_set(json.loads(good), "choices", [])), 4, IDENTITY),
        ("choices an object", json.dumps(_set(json.loads(good), "choices", {"a": 1})), 4, IDENTITY),
        ("machine a number", json.dumps(_set(json.loads(good), "machine", 3)), 4, IDENTITY),
        ("model a list", json.dumps(_set(json.loads(good), "model", [])), 4, IDENTITY),
        ("no bound", json.dumps(_delete(json.loads(good), "bound")), 4, IDENTITY),
        ("text null", json.dumps(_set(json.loads(good), "text", None)), 4, IDENTITY),
        ("bound.on vibes", json.dumps(_set(json.loads(good), "bound.on", "vibes")), 4, IDENTITY),
        ("bound.on 95%", json.dumps(_set(json.loads(good), "bound.on", "95% CI upper end")), 4, IDENTITY),
        ("bound a string", json.dumps(_set(json.loads(good), "bound.max_delta_ppl_pct", "1%")), 4, IDENTITY),
        ("bound 0.5", json.dumps(_set(json.loads(good), "bound.max_delta_ppl_pct", 0.5)), 4, IDENTITY),
        # harness tune's record of its speed measurements (informational: neither reader checks it)
        ("with stability", profile_to_json(replace(_profile(), speeds=(
            SpeedCheck("decode in memory, cache off", (100.0, 80.0, 120.0), (10.0, 100.0)),
            SpeedCheck("decode with the engine, x", (50.0,))))), 4, IDENTITY),
        ("stability damaged", json.dumps({**base, "stability": {"speeds": [1, "x"], "stable": "?"}}), 4, IDENTITY),
    ]
    for path, value in [("delta_pct", "big"), ("ci_low", None), ("ci_high", True), ("fraction", [1]),
                        ("est_tokens_per_s", "fast"), ("slots", 4.5), ("slots", True), ("slots", "4"),
                        ("policy", "mode=engine,rule=zero"), ("policy", "rule=zero,rule=lfu"), ("policy", ""),
                        ("policy", 3), ("policy", "slots=4"), ("policy", " rule = zero , tau=0.3"),
                        ("policy", "halve=on,tau_file=0.5")]:
        cases.append((f"choices.1.{path} {value!r}", json.dumps(_set(json.loads(good), f"choices.1.{path}", value)),
                      4, IDENTITY))
    # every key the reference requires, removed in turn: both readers name it
    for obj, cls in (("model", ModelIdentity), ("machine", MachineFacts), ("choices.0", TuneChoice)):
        for f in fields(cls):
            cases.append((f"no {obj}.{f.name}", json.dumps(_delete(json.loads(good), f"{obj}.{f.name}")), 4,
                          IDENTITY))
    return cases


def _comparable(why: str) -> str:
    """The reason without what the JSON parsers say in their own words (where in the text it failed) and the reader's
    own name for itself (the Python reference: 'this harness reads 1'; the build: 'this build reads 1')."""
    why = re.sub(r" is not JSON \(.*\)\)$", " is not JSON (...))", why)
    return re.sub(r"; this (harness|build) reads ", "; this reader reads ", why)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_the_reader_agrees_with_the_reference(case: tuple[str, str | None, int, ModelIdentity], tuned_read: Path,
                                              tmp_path: Path) -> None:
    name, text, slots, mine = case
    path = tmp_path / "m.gguf.moe-tune.json"
    if text is not None:
        path.write_text(text)
    want = auto_policy(text, str(path), mine, slots)
    got = _cpp(tuned_read, "--policy", str(path) if text is not None else "-", mine.file_name, str(mine.file_bytes),
               mine.fingerprint, str(slots)).rstrip("\n").split("\t", 1)
    assert got[0] == want[0], (name, got, want)
    assert _comparable(got[1]) == _comparable(want[1]), (name, got[1], want[1])
    assert "\n" not in got[1]


def test_the_reference_on_the_cases_by_hand(tmp_path: Path) -> None:
    """What the shared cases mean (so that an agreement on a wrong answer fails here)."""
    good = profile_to_json(_profile())
    assert auto_policy(good, "p", IDENTITY, 4) == (TUNED, f"policy {TUNED} (tuned 2026-12-02T00:00:00+00:00: delta-PPL "
                                                   "+0.75% [+0.46, +1.06] <= 1% on the point estimate at 25%)")
    assert auto_policy(good, "p", IDENTITY, 3)[1].endswith("delta-PPL -0.00% [-1.50, +2.25] <= 1% on the point "
                                                          "estimate at 12.5%)")
    assert auto_policy(good, "p", IDENTITY, 1) == ("", "policy quality (the tuned profile p was tuned at 25% (4 "
                                                   "slots), 12.5% (2 slots), more than the 1 slots planned)")
    pol, why = auto_policy(good, "p", replace(IDENTITY, file_bytes=1), 4)
    assert pol == "" and why.startswith("policy quality (the tuned profile p is of another model (m.gguf: 1234 bytes")
    assert why.endswith("run harness tune on this model)")
    assert auto_policy("{", "p", IDENTITY, 4)[1].startswith("policy quality (the tuned profile p is not JSON")
    pol, why = auto_policy(json.dumps(_set(json.loads(good), "choices.0.slots", "4")), "p", IDENTITY, 4)
    assert pol == "" and "choices[0].slots is '4', not an integer" in why


def test_the_policy_keys_are_one_table(tuned_read: Path) -> None:
    assert tuple(_cpp(tuned_read, "--policy-keys").split()) == POLICY_KEYS


@pytest.mark.parametrize("env", [{}, {"XDG_CACHE_HOME": "/x"}, {"XDG_CACHE_HOME": "/x/", "MOE_SUBST_CACHE": "/m"},
                                 {"MOE_SUBST_CACHE": ""}, {"MOE_SUBST_CACHE": "", "XDG_CACHE_HOME": ""}])
@pytest.mark.parametrize("model", ["/models/q.gguf", "rel/q-00001-of-00002.gguf", "q.gguf"])
def test_the_locations_are_the_reference_s(env: dict[str, str], model: str, tuned_read: Path) -> None:
    home = Path("/home/u")
    want = [str(p) for p in profile_locations(Path(model), tune_cache_dir(env, home), IDENTITY.fingerprint)]
    got = _cpp(tuned_read, "--locations", model, IDENTITY.fingerprint, env.get("MOE_SUBST_CACHE", "-"),
               env.get("XDG_CACHE_HOME", "-"), str(home)).split()
    assert got == want


def test_the_locations_by_hand() -> None:
    """What the shared locations mean: beside the model, the cache folder keyed by the fingerprint, then the cache
    folder's name-only path (written before the key)."""
    assert [str(p) for p in profile_locations(Path("/models/q.gguf"), Path("/m"), "00000000deadbeef")] == [
        "/models/q.gguf.moe-tune.json", "/m/tune/q.gguf.00000000deadbeef.moe-tune.json", "/m/tune/q.gguf.moe-tune.json"]


def test_find_takes_the_first_regular_file(tuned_read: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    cache = tmp_path / "cache"
    beside, keyed, legacy = profile_locations(model, cache, IDENTITY.fingerprint)
    env = {**os.environ, "MOE_SUBST_CACHE": str(cache)}

    def find(fingerprint: str = IDENTITY.fingerprint) -> str:
        res = subprocess.run([str(tuned_read), "--find", str(model), fingerprint], capture_output=True, text=True,
                             timeout=30, env=env)
        return res.stdout.strip()

    assert find() == "-"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("{}")
    assert find() == str(legacy)  # the name-only path of a profile written before the key: the last place
    keyed.write_text("{}")
    assert find() == str(keyed)  # the model's own keyed profile comes before it
    assert find("1" * 16) == str(legacy)  # another model of the same file name: not this model's keyed profile
    legacy.unlink()
    assert find("1" * 16) == "-"
    os.mkfifo(beside)  # exists, not a regular file: not opened (the run would block), the next place is read
    assert find() == str(keyed)
    beside.unlink()
    beside.mkdir()
    assert find() == str(keyed)
    beside.rmdir()
    beside.write_text("{}")
    assert find() == str(beside)


def test_two_models_of_one_file_name_keep_their_profiles(tuned_read: Path, tmp_path: Path) -> None:
    """Two models called m.gguf in the cache folder: each reader finds each model's own profile and runs its policy;
    an old name-only profile is used for the model it was tuned on and refused, in the line, for the other."""
    cache = tmp_path / "cache"
    one, two = replace(IDENTITY, file_bytes=1000), replace(IDENTITY, file_bytes=2000, fingerprint="0123456789abcdef")
    env = {**os.environ, "MOE_SUBST_CACHE": str(cache)}
    for mine in (one, two):
        keyed = profile_locations(tmp_path / mine.fingerprint / "m.gguf", cache, mine.fingerprint)[1]
        keyed.parent.mkdir(parents=True, exist_ok=True)
        keyed.write_text(profile_to_json(replace(_profile(mine), bound_pct=mine.file_bytes / 1000)))

    def policy(mine: ModelIdentity) -> tuple[str, str, tuple[str, str]]:
        model = tmp_path / mine.fingerprint / "m.gguf"
        res = subprocess.run([str(tuned_read), "--find", str(model), mine.fingerprint], capture_output=True,
                             text=True, timeout=30, env=env)
        path = res.stdout.strip()
        assert path != "-"
        got = _cpp(tuned_read, "--policy", path, mine.file_name, str(mine.file_bytes), mine.fingerprint, "4")
        want = auto_policy(Path(path).read_text(), path, mine, 4)
        cpp_policy, cpp_why = got.rstrip("\n").split("\t", 1)
        assert (cpp_policy, cpp_why) == want
        return path, cpp_policy, want

    for mine in (one, two):
        path, pol, (_, why) = policy(mine)
        assert path.endswith(f"m.gguf.{mine.fingerprint}.moe-tune.json") and pol == TUNED
        assert f"<= {mine.file_bytes / 1000:g}% on the point estimate" in why  # its own profile, not the other's
    # the name-only path (harness tune before the key), model one's: found for two once its keyed one is gone, refused
    legacy = profile_locations(tmp_path / "m.gguf", cache, one.fingerprint)[2]
    legacy.write_text(profile_to_json(_profile(one)))
    profile_locations(tmp_path / two.fingerprint / "m.gguf", cache, two.fingerprint)[1].unlink()
    path, pol, (_, why) = policy(two)
    assert path == str(legacy) and pol == "" and "is of another model" in why
    profile_locations(tmp_path / one.fingerprint / "m.gguf", cache, one.fingerprint)[1].unlink()
    path, pol, _ = policy(one)
    assert path == str(legacy) and pol == TUNED


# ---- with the real build -------------------------------------------------------------------------------------


def _fake_machine(root: Path, limit: int) -> Path:
    """A fake /proc and /sys: 16 GiB available, this process in a v2 cgroup whose parent is limited to `limit`."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 33554432 kB\nMemAvailable: 16777216 kB\n")
    (root / "proc" / "self" / "cgroup").write_text("0::/job/run\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "run").mkdir(parents=True)
    (root / "sys" / "fs" / "cgroup" / "job" / "memory.max").write_text(f"{limit}\n")
    (root / "sys" / "fs" / "cgroup" / "job" / "memory.current").write_text("0\n")
    return root


def _run(build: Build, model: Path, text: Path, env: dict[str, str], *extra: str) -> tuple[int, str]:
    args = [str(build.tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "128", "-b", "128",
            "--chunks", "1", "-t", "2", "-ub", "1", *extra]
    base = {k: v for k, v in os.environ.items()
            if k not in ("LLAMA_MOE_CACHE", "LLAMA_MOE_CACHE_MACHINE_ROOT", "MOE_SUBST_CACHE", "XDG_CACHE_HOME")}
    res = subprocess.run(args, env={**base, **env}, capture_output=True, text=True, timeout=600)
    return res.returncode, res.stdout + res.stderr


def _auto_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if "llama_expert_cache: auto: " in ln]
    assert len(lines) == 1, out[-3000:]
    return lines[0].split("llama_expert_cache: auto: ", 1)[1]


@pytest.mark.build
def test_auto_runs_the_tuned_policy(patched_build: Build, synth_text_file: Path, tmp_path: Path) -> None:
    # 147 MiB of model file in a 120 MiB limit: the file tier (a file that fits is near the fit: stock)
    model = write_synth_model(SynthSpec(n_layer=2, n_expert=48, n_expert_used=4, n_embd=256, n_ff_exp=512),
                              tmp_path / "m.gguf")
    cache = tmp_path / "cache"
    env = {"LLAMA_MOE_CACHE_MACHINE_ROOT": str(_fake_machine(tmp_path / "machine", 120 * MiB)),
           "MOE_SUBST_CACHE": str(cache)}
    stats = tmp_path / "s.json"

    def run(spec: str, *extra: str) -> tuple[str, dict[str, Any]]:
        stats.unlink(missing_ok=True)
        rc, out = _run(patched_build, model, synth_text_file,
                       {**env, "LLAMA_MOE_CACHE": f"{spec},vram_reserve=16M,stats={stats}"}, *extra)
        assert rc == 0, out[-3000:]
        return _auto_line(out), json.loads(stats.read_text())["config"]

    # without a profile: quality, and the slots it planned
    line, cfg = run("auto")
    assert "policy quality (no tuned profile)" in line and cfg["policy"] == "quality", line
    slots = int(re.search(r"file tier: (\d+) of 48 experts per layer", line)[1])  # type: ignore[index]
    assert cfg["slots"] == slots

    # harness's own writer, the model's identity: the entry at the planned slots, not the one above them
    mine = ModelIdentity("synth", model.name, model.stat().st_size, f"{model_fingerprint(model):016x}", 48, 4, 2)
    beside, cached, legacy = profile_locations(model, tune_cache_dir({"MOE_SUBST_CACHE": str(cache)}, Path.home()),
                                               f"{model_fingerprint(model):016x}")
    beside.write_text(profile_to_json(_profile(mine, slots=(slots + 1, slots))))
    line, cfg = run("auto")
    want = auto_policy(beside.read_text(), str(beside), mine, slots)
    assert want[0] == WIDE
    assert line.endswith(want[1]), (line, want)
    assert re.match(rf"mode=engine,{WIDE},host=file,ram=\d+M,vram_reserve=16M,stats=", line), line
    assert (cfg["rule"], cfg["evict"], cfg["admit"], cfg["slots"]) == ("threshold", "lru", True, slots), cfg
    assert cfg["tau"] == pytest.approx(0.1) and cfg["spec"].startswith(f"mode=engine,{WIDE},host=file"), cfg
    # the user's policy wins; a user's key overrides a tuned one of the same name
    line, cfg = run("auto,policy=speed")
    assert "policy speed (given)" in line and cfg["policy"] == "speed"
    line, cfg = run("auto,tau=0.2")
    assert ",tau=0.2," in line + "," and cfg["tau"] == pytest.approx(0.2) and cfg["rule"] == "threshold"
    # --moe-cache auto reads it too
    rc, out = _run(patched_build, model, synth_text_file, env, "--moe-cache", "auto,vram_reserve=16M")
    assert rc == 0 and _auto_line(out).endswith(want[1])

    # not used, the line says why, auto runs quality: another model, another size, another schema_version, not JSON
    text = beside.read_text()
    for bad, why in [(profile_to_json(_profile(replace(mine, fingerprint="0" * 15 + "1"), slots=(slots, slots))),
                      "is of another model"),
                     (profile_to_json(_profile(replace(mine, file_bytes=mine.file_bytes + 1), slots=(slots, slots))),
                      "is of another model"),
                     (text.replace('"schema_version": 1', '"schema_version": 2'), "has schema_version 2; this build"),
                     (text[:-10], "is not JSON (")]:
        beside.write_text(bad)
        line, cfg = run("auto")
        assert re.search(rf"; policy quality \(the tuned profile {re.escape(str(beside))} {re.escape(why)}", line), line
        assert cfg["policy"] == "quality" and cfg["slots"] == slots

    # a policy value this build refuses (the reference checks the keys only): not used, the line names the parser's
    # words; a tuned prefetch=on with the user's async=off: refused in one line naming the profile
    beside.write_text(text.replace(WIDE, "rule=banana,evict=lru"))
    line, cfg = run("auto")
    assert f"; policy quality (the tuned profile {beside} has a policy this build refuses: " in line and "rule" in line
    assert cfg["policy"] == "quality"
    beside.write_text(text.replace(WIDE, WIDE.replace("prefetch=off", "prefetch=on")))
    line, cfg = run("auto")
    assert cfg["prefetch"] is True and cfg["rule"] == "threshold", cfg
    rc, out = _run(patched_build, model, synth_text_file, {**env, "LLAMA_MOE_CACHE": "auto,vram_reserve=16M,async=off"})
    lines = [ln for ln in out.splitlines() if "prefetch=on" in ln and "async=off" in ln]
    assert rc != 0 and lines and f"the policy keys are the tuned profile {beside}'s" in lines[0], out[-3000:]

    # the cache folder is the second place, keyed by the fingerprint; a FIFO in the first is not opened (the run
    # would block on it)
    beside.unlink()
    cached.parent.mkdir(parents=True)
    cached.write_text(text)
    os.mkfifo(beside)
    line, cfg = run("auto")
    assert line.endswith(auto_policy(text, str(cached), mine, slots)[1]) and cfg["rule"] == "threshold", line
    # the name-only path (harness tune before the key): after the keyed one; used when it is this model's
    legacy.write_text(text.replace(WIDE, TUNED))
    line, cfg = run("auto")
    assert cfg["rule"] == "threshold", line  # the keyed profile's policy, not the name-only one's (zero)
    cached.unlink()
    line, cfg = run("auto")
    assert line.endswith(auto_policy(legacy.read_text(), str(legacy), mine, slots)[1]) and cfg["rule"] == "zero", line
