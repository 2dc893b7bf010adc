"""The cache spec's rules (docs/expert-cache.md "Spec rules"), through the real parser (src/llama, compiled here
with tests/cpp/spec_parse.cpp): each key once, spaces trimmed around items, keys and values, conflicts are errors
that name the key, and a bounded fuzz loop of random and mutated specs never crashes and always answers one line."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.core import project

SRC = project.project_root() / "src"


@pytest.fixture(scope="module")
def spec_parse(tmp_path_factory: pytest.TempPathFactory, policy_sources: list[Path]) -> Path:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("spec") / "spec_parse"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{SRC / 'llama'}", f"-I{SRC / 'include'}",
                    str(project.project_root() / "tests" / "cpp" / "spec_parse.cpp"),
                    *map(str, policy_sources), "-o", str(exe)], check=True)
    return exe


CASES = [
    ("mode=emulate,policy=quality,slots=25%", "ok"),
    (" mode = emulate , policy = quality , tau = 0.2 ", "ok"),  # spaces around items, keys and values
    ("policy=quality,tau=0.2", "ok"),
    ("rule=threshold,tau=0.3,slots=16", "ok"),
    ("slots=4,slots=8", "error: key 'slots' is given twice ('4' and '8')"),
    ("engine,mode=engine", "error: key 'mode' is given twice"),
    ("policy=speed,tau=0.2",
     "error: tau applies to rule=threshold (policy=quality) or rule=zero, not to rule=first-choice"),
    ("policy=quality,rule=first-choice,tau=0.2", "error: tau applies to rule=threshold"),
    ("mode=off,stats=s.json", "ok"),  # accepted; the context warns that stats has no effect
    ("off", "ok"),
    ("mode=off", "ok"),
    ("bogus=1", "error: unknown key 'bogus'"),
    ("ta\nu=1", "error: unknown key 'ta\\x0au'"),  # control bytes shown, the message stays one line
    ("mode=engine,host=file,ram=1G,vram=1G", "error: ram= and vram= are two budgets"),
    ("mode=engine,host=file,readers=8,direct=off", "ok"),
    ("mode=engine,host=file,readers=64,direct=on", "ok"),
    ("mode=engine,host=file,readers=65", "error: bad value '65' for key 'readers'"),
    ("mode=engine,host=file,readers=0", "error: bad value '0' for key 'readers'"),
    ("mode=engine,host=file,direct=maybe", "error: bad value 'maybe' for key 'direct'"),
    ("mode=engine,readers=2", "error: readers= sets how host=file reads"),
    ("mode=engine,direct=off", "error: direct= sets how host=file reads"),
    ("mode=off,readers=2", "ok"),  # mode=off: ignored keys are a warning
    ("mode=emulate,host=file,policy=quality,tau_file=0.4", "ok"),
    ("mode=emulate,host=file,ram=4G", "ok"),
    ("mode=engine,host=file,policy=quality,ram_slots=50%,tau_file=0.3", "ok"),
    ("mode=engine,host=file,ram_slots=64", "ok"),
    ("mode=engine,host=file,ram=64M,runtime=12M", "ok"),
    ("mode=engine,host=file,slots=8,runtime=12M", "error: runtime= is a term of the ram= budget"),
    ("mode=engine,host=file,ram=64M,runtime=0", "error: bad value '0' for key 'runtime'"),
    ("mode=engine,ram_slots=64", "error: ram_slots is a RAM tier between the slots and the model file"),
    ("mode=engine,host=file,ram_slots=0", "error: bad value '0' for key 'ram_slots'"),
    ("mode=engine,host=file,ram_slots=150%", "error: bad value '150%' for key 'ram_slots'"),
    ("policy=quality,prefetch=on", "ok"),
    ("mode=engine,policy=quality,prefetch=on,async=thread", "ok"),
    ("policy=quality,prefetch=maybe", "error: bad value 'maybe' for key 'prefetch' (accepted: on"),
    ("prefetch=on,prefetch=off", "error: key 'prefetch' is given twice"),
    ("mode=engine,prefetch=on,async=off", "error: prefetch=on copies the predicted experts in the background, and "
     "async=off makes every copy synchronous"),
    ("mode=off,prefetch=on", "ok"),  # mode=off: ignored keys are a warning
    ("mode=emulate,host=file,readers=2", "error: readers= sets how mode=engine reads the model file"),
    ("mode=engine,host=file,policy=speed,tau_file=0.4", "error: tau_file applies to rule=threshold"),
    ("mode=engine,policy=quality,tau_file=0.4", "error: tau_file is the threshold for misses read from the model"),
    ("policy=quality,profile_out=p.txt,profile_every=256", "ok"),
    ("policy=quality,profile_out=p.txt,profile_every=0", "ok"),
    ("policy=quality,profile_every=256",
     "error: profile_every= writes the profile_out= file during the run: it needs profile_out="),
    ("policy=quality,profile_out=p.txt,profile_every=-1", "error: bad value '-1' for key 'profile_every'"),
    # rule=budget (issue 37): a per-token gate-weight budget
    ("rule=budget,mass=0.2", "ok"),
    ("rule=budget,mass=2", "error: bad value '2' for key 'mass'"),
    ("policy=quality,mass=0.2", "error: mass applies to rule=budget"),
    # the shadow estimate (issue 37): emulate mode only
    ("policy=quality,shadow=32", "ok"),
    ("policy=quality,shadow=0", "ok"),
    ("mode=engine,policy=quality,shadow=32",
     "error: shadow= computes a ubatch exactly with the full expert tensors, which mode=engine's banks replace"),
    ("mode=engine,policy=quality,shadow=0", "ok"),
    ("policy=quality,shadow=-1", "error: bad value '-1' for key 'shadow'"),
    ("mode=engine,host=file,policy=quality,tau_file=1.5", "error: bad value '1.5' for key 'tau_file'"),
    # the anchors' policies (issue 13): values and ranges
    ("rule=cache-route", "ok"),
    ("rule=cache-route,j=2,m=16,alpha=0.5", "ok"),
    ("rule=cache-route,m=auto,alpha=0,j=0", "ok"),
    ("rule=cache-route,alpha=1.01", "error: bad value '1.01' for key 'alpha' (accepted: a weight scale in [0, 1])"),
    ("rule=cache-route,alpha=-0.5", "error: bad value '-0.5' for key 'alpha'"),
    ("rule=cache-route,m=0", "error: bad value '0' for key 'm' (accepted: a window of router ranks in [k, n_expert], "
                             "or auto (2k))"),
    ("rule=cache-route,j=-1", "error: bad value '-1' for key 'j' (accepted: a number of ranks in [0, k]"),
    ("policy=quality,j=2", "error: j applies to rule=cache-route, not to rule=threshold"),
    ("rule=cache-route,light=host,alpha=0.5", "error: alpha chooses and weighs substitutes, and light=host"),
    ("rule=zero", "ok"),
    ("rule=zero,tau=0.05,renorm=on", "ok"),
    ("rule=zero,renorm=maybe", "error: bad value 'maybe' for key 'renorm' (accepted: on"),
    ("rule=zero,tau=2", "error: bad value '2' for key 'tau' (accepted: a number in [0, 1])"),
    ("policy=quality,renorm=on",
     "error: renorm applies to the rules that drop (drop, zero, ser), not to rule=threshold"),
    ("rule=drop,renorm=on", "ok"),
    ("rule=ser,kmin=6,t=0.2", "ok"),
    ("rule=ser,kmin=0", "error: bad value '0' for key 'kmin' (accepted: a number of ranks in [1, k]"),
    ("rule=ser,t=1.5",
     "error: bad value '1.5' for key 't' (accepted: a ratio to the first choice's gate weight in [0, 1])"),
    ("rule=zero,t=0.5", "error: t applies to rule=ser, not to rule=zero"),
    ("evict=classlru", "ok"),
    ("policy=quality,evict=classlru,half_life=64,classes=4", "ok"),
    ("evict=classlru,classes=0", "error: bad value '0' for key 'classes' (accepted: a number of classes in [1, 32])"),
    ("evict=classlru,half_life=0", "error: bad value '0' for key 'half_life' (accepted: a number of tokens >= 1)"),
    ("evict=mru", "error: bad value 'mru' for key 'evict' (accepted: lfu, lru, classlru)"),
    ("policy=quality,half_life=64", "error: half_life applies to evict=classlru, not to evict=lfu"),
    ("policy=quality,light=host", "ok"),
    ("policy=speed,light=substitute", "ok"),
    ("policy=quality,light=gpu", "error: bad value 'gpu' for key 'light' (accepted: substitute"),
    ("rule=zero,light=host", "error: light applies to the rules that substitute"),
    ("mode=engine,policy=quality,light=host", "error: light=host (experts computed on the host) is not implemented in "
                                              "mode=engine yet"),
    ("rule=band,lo=0.3", "ok"),
    ("rule=band,hi=0.08,evict=lfu,admit=off", "ok"),
    ("rule=band,lo=0.1,hi=0.3,light=host", "ok"),
    ("rule=band,lo=0.3,hi=0.1", "error: rule=band substitutes the misses with gate weight in [lo, hi): lo (0.3"),
    ("rule=band,hi=1.5", "error: bad value '1.5' for key 'hi' (accepted: the band's upper gate weight bound in [0, 1]"),
    ("policy=quality,lo=0.3", "error: lo applies to rule=band, not to rule=threshold"),
    # max_rank (issue 22): the ranks the band substitutes at are [min_rank, max_rank]
    ("rule=band,lo=0,hi=0.15,max_rank=0", "ok"),
    ("rule=band,lo=0.15,hi=1,min_rank=1", "ok"),
    ("rule=band,min_rank=1,max_rank=1", "ok"),
    ("rule=band,min_rank=2,max_rank=1",
     "error: rule=band substitutes at the ranks in [min_rank, max_rank]: min_rank (2) must not be above max_rank (1)"),
    ("rule=band,max_rank=-1", "error: bad value '-1' for key 'max_rank' (accepted: the last rank the band substitutes "
                              "at, in [0, k-1]"),
    ("rule=first-choice,max_rank=0", "error: max_rank applies to rule=band, not to rule=first-choice"),
    ("rule=bands", "error: bad value 'bands' for key 'rule' (accepted: fetch-all, threshold, first-choice, "
                   "substitute-all, drop, cache-route, zero, ser, band, budget)"),
    # two path keys on one file (issue 35): stats= and trace= there destroyed both and exited 0
    ("policy=quality,stats=s.json,trace=s.json",
     "error: stats=s.json and trace=s.json name the same file: one would overwrite the other; give each its own path"),
    ("stats=./out//s.json,trace=out/s.json/", "error: stats=./out//s.json and trace=out/s.json/ name the same file"),
    ("profile_out=p.txt,stats=p.txt", "error: profile_out=p.txt and stats=p.txt name the same file"),
    ("profile=p.txt,trace=p.txt", "error: profile=p.txt and trace=p.txt name the same file"),
    ("profile=p.txt,profile_out=p.txt", "ok"),  # a profile updated in place: read at the start, written at the end
    ("stats=s.json,trace=t.bin,profile_out=p.txt", "ok"),
    ("stats=/dev/null,trace=/dev/null", "ok"),  # a device is no file to lose
    ("mode=off,stats=s.json,trace=s.json", "ok"),  # mode=off writes nothing (the other keys are a warning)
]

# the checks that need the model: k = 8 experts per token of 64 (the cache and llama-moe-sim make them)
CASES_K = [
    ("rule=cache-route,j=8,m=8", "ok"),
    ("rule=cache-route,m=64", "ok"),
    ("rule=cache-route,j=9",
     "error: bad value '9' for key 'j' (accepted: a number of ranks in [0, 8], the experts used per token)"),
    ("rule=cache-route,m=7", "error: bad value '7' for key 'm' (accepted: a window of router ranks in [8, 64]"),
    ("rule=cache-route,m=65", "error: bad value '65' for key 'm'"),
    ("rule=ser,kmin=8", "ok"),
    ("rule=ser,kmin=9", "error: bad value '9' for key 'kmin' (accepted: a number of ranks in [1, 8]"),
    ("rule=band,min_rank=8", "ok"),
    ("rule=band,min_rank=9", "error: bad value '9' for key 'min_rank' (accepted: a rank in [0, 8]"),
    ("rule=band,lo=0,hi=1,max_rank=7", "ok"),
    ("rule=band,lo=0,hi=1,max_rank=8",
     "error: bad value '8' for key 'max_rank' (accepted: a rank in [0, 7], below the experts used per token (8))"),
    ("policy=quality", "ok"),
]


def test_spec_rules(spec_parse: Path) -> None:
    out = subprocess.run([str(spec_parse), "--spec", *(c for c, _ in CASES)], capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert len(out) == len(CASES), out
    for (spec, want), got in zip(CASES, out, strict=True):
        assert got.startswith(want), f"{spec!r}: {got!r}"


def test_spec_refuses_two_path_keys_on_one_existing_file(spec_parse: Path, tmp_path: Path) -> None:
    """The same file under other names: a hard link, a symbolic link, a relative and an absolute path to a file not
    written yet (its folder is the same); distinct files and names pass."""
    (tmp_path / "run").mkdir()
    (tmp_path / "s.json").write_text("{}")
    (tmp_path / "hard.json").hardlink_to(tmp_path / "s.json")
    (tmp_path / "soft.json").symlink_to(tmp_path / "s.json")
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "dir-link").symlink_to(tmp_path / "run")
    cases = [
        (f"stats={tmp_path}/s.json,trace={tmp_path}/hard.json", "error: stats="),
        ("stats=soft.json,trace=s.json", "error: stats=soft.json and trace=s.json name the same file"),
        (f"stats=run/new.json,trace={tmp_path}/run/new.json", "error: stats=run/new.json and trace="),
        ("stats=dir-link/new.json,profile_out=run/new.json", "error: profile_out=run/new.json and stats="),
        ("stats=s.json,trace=other.json", "ok"),
        ("stats=run/a.json,trace=run/b.json", "ok"),
        ("stats=run/x,trace=x", "ok"),  # one name in two folders
    ]
    out = subprocess.run([str(spec_parse), "--spec", *(c for c, _ in cases)], capture_output=True, text=True,
                         check=True, timeout=60, cwd=tmp_path).stdout.splitlines()
    assert len(out) == len(cases), out
    for (spec, want), got in zip(cases, out, strict=True):
        assert got.startswith(want), f"{spec!r}: {got!r}"
    assert (tmp_path / "s.json").read_text() == "{}"


def test_spec_checks_with_the_model(spec_parse: Path) -> None:
    out = subprocess.run([str(spec_parse), "--spec-k", "8", "64", *(c for c, _ in CASES_K)], capture_output=True,
                         text=True, check=True, timeout=60).stdout.splitlines()
    assert len(out) == len(CASES_K), out
    for (spec, want), got in zip(CASES_K, out, strict=True):
        assert got.startswith(want), f"{spec!r}: {got!r}"


def test_spec_fuzz_never_crashes_and_answers_one_line(spec_parse: Path) -> None:
    for seed in (1, 2, 3):
        res = subprocess.run([str(spec_parse), "--fuzz", "20000", str(seed)], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        assert res.stdout.startswith("fuzz: 20000 specs,"), res.stdout


def test_every_catalogue_policy_is_a_spec_the_engine_accepts(spec_parse: Path) -> None:
    """Each named policy of harness.domain.catalogue, in emulate and engine mode with slots, passes the engine's
    parser and its checks against a model (k = 8 of 64 experts): a row with a key or value the engine refuses fails
    here, not in the middle of a comparison."""
    from harness.domain.catalogue import POLICIES, policy_cache_spec

    specs = [policy_cache_spec(p, mode, 16, None).render() for p in POLICIES for mode in ("emulate", "engine")]
    out = subprocess.run([str(spec_parse), "--spec-k", "8", "64", *specs], capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert len(out) == len(specs), out
    for spec, got in zip(specs, out, strict=True):
        assert got.startswith("ok"), f"{spec!r}: {got!r}"
