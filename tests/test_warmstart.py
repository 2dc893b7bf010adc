"""harness.orchestration.warmstart: every cached run from the routing profile of calibration text (issue 36): the
calibration default, the profile run and its reuse, the refusals, the spec of every run of a sweep, and with the
real build, that a warm start is what it claims (substitute-all, which never fetches, hits more from it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_compare import FakeEnv, _info
from test_sweep import SweepFake

from harness.cli.app import main
from harness.core.errors import HarnessError
from harness.core.project import Build, project_root
from harness.domain.options import SweepGrid, SweepOptions
from harness.orchestration.sweep import run_sweep
from harness.orchestration.warmstart import (
    HELDOUT,
    HELDOUT_DOCS,
    WARM_CHUNKS,
    default_calibration,
    refuse_cold_never_fetching,
    warm_start,
)
from harness.tools.requests import CacheSpec, PerplexityRequest, PerplexityRun

ROOT = project_root()


class ProfileFake(SweepFake):
    """Writes the profile a `profile_out=` run asks for (`layers` lines), as the engine does."""

    def __init__(self, layers: int = 2, write: bool = True) -> None:
        super().__init__()
        self.layers, self.write, self.requests = layers, write, []  # type: ignore[var-annotated]

    def perplexity(self, build: Build, req: PerplexityRequest) -> PerplexityRun:
        self.requests.append(req)
        out = dict(req.cache.extra).get("profile_out") if req.cache is not None else None
        if out is not None and self.write:
            Path(out).write_text("moe-expert-profile 1\n" + "".join(
                f"layer {il} 16 " + " ".join(str(16 - e) for e in range(16)) + "\n" for il in range(self.layers)))
        return super().perplexity(build, req)


def _files(tmp_path: Path) -> tuple[Path, Path, Path]:
    model, text, calib = tmp_path / "m.gguf", tmp_path / "t.txt", tmp_path / "calib.txt"
    model.write_bytes(b"GGUF")
    text.write_text("evaluated text\n")
    calib.write_text("calibration text\n")
    return model, text, calib


def test_default_calibration_is_the_other_held_out_text() -> None:
    assert default_calibration(None) == ROOT / HELDOUT_DOCS
    assert default_calibration(ROOT / HELDOUT) == ROOT / HELDOUT_DOCS
    assert default_calibration(ROOT / HELDOUT_DOCS) == ROOT / HELDOUT  # never the evaluated text
    assert default_calibration(ROOT / "eval/data/topic-shift.txt") == ROOT / HELDOUT_DOCS


def test_warm_start_runs_once_and_is_reused(tmp_path: Path) -> None:
    model, text, calib = _files(tmp_path)
    opts = SweepOptions(out=tmp_path / "out", model=model, text=text, n_ctx=128, warm_from=calib)
    runner = ProfileFake()
    build = Build("patched", "cpu", tmp_path)
    warm = warm_start(opts, model, text, tmp_path / "out" / "warm", runner, build, 16, 2)
    assert warm.warm_profile is not None and warm.warm_profile.is_file()
    (req,) = runner.requests
    assert req.text == calib and req.chunks == WARM_CHUNKS and req.n_ctx == 128 and req.nll_dump is None
    assert req.cache is not None and req.cache.policy == "fetch-all" and req.cache.slots == 16  # the full routing
    assert not list((tmp_path / "out" / "warm").glob("*.tmp"))
    again = warm_start(opts, model, text, tmp_path / "out" / "warm", runner, build, 16, 2)
    assert again.warm_profile == warm.warm_profile and len(runner.requests) == 1  # reused, not run again
    calib.write_text("other calibration text\n")  # another calibration: another profile
    other = warm_start(opts, model, text, tmp_path / "out" / "warm", runner, build, 16, 2)
    assert other.warm_profile != warm.warm_profile and len(runner.requests) == 2
    assert warm_start(SweepOptions(out=tmp_path, model=model, text=text), model, text, tmp_path, runner, build,
                      16).warm_profile is None  # warm_from None: cold, nothing run
    assert len(runner.requests) == 2


def test_warm_start_refusals(tmp_path: Path) -> None:
    model, text, calib = _files(tmp_path)
    build = Build("patched", "cpu", tmp_path)

    def start(warm_from: Path, runner: ProfileFake, layers: int = 2) -> None:
        warm_start(SweepOptions(out=tmp_path / "o", model=model, text=text, warm_from=warm_from), model, text,
                   tmp_path / "o", runner, build, 16, layers)

    with pytest.raises(HarnessError, match="is the evaluated text"):
        start(text, ProfileFake())
    with pytest.raises(HarnessError, match="no such file"):
        start(tmp_path / "missing.txt", ProfileFake())
    with pytest.raises(HarnessError, match="wrote no profile"):
        start(calib, ProfileFake(write=False))
    with pytest.raises(HarnessError, match="has 3 layers, the model 2"):
        start(calib, ProfileFake(layers=3))
    with pytest.raises(HarnessError, match="never fetches"):
        refuse_cold_never_fetching(("fetch-all", "substitute-all"), None)
    refuse_cold_never_fetching(("fetch-all", "substitute-all"), calib)  # warm: allowed
    refuse_cold_never_fetching(("fetch-all", "quality"), None)  # cold, but every policy fetches


def test_settings_warm_only_for_a_cache_that_is_on(tmp_path: Path) -> None:
    opts = SweepOptions(out=tmp_path, warm_profile=tmp_path / "w.profile")
    assert opts.warm(CacheSpec("off")) == CacheSpec("off")
    assert opts.warm(None) is None
    on = opts.warm(CacheSpec("emulate", "quality", 4))
    assert on is not None and on.render() == f"mode=emulate,policy=quality,slots=4,profile={tmp_path}/w.profile"
    given = CacheSpec("engine", None, 4, None, (("profile", "mine"),))
    assert opts.warm(given) == given  # a profile the caller chose stays
    assert SweepOptions(out=tmp_path).warm(CacheSpec("emulate", "quality", 4)) == CacheSpec("emulate", "quality", 4)


def test_sweep_every_cached_run_starts_warm(tmp_path: Path) -> None:
    model, text, calib = _files(tmp_path)
    grid = SweepGrid(rules=("fetch-all", "threshold", "substitute-all"), taus=(0.1,), admits=("off",))
    opts = SweepOptions(out=tmp_path / "out", model=model, text=text, grid=grid, warm_from=calib)
    runner = ProfileFake(layers=_info().n_moe_layers)
    res = run_sweep(opts, runner, _info(), env=FakeEnv(tmp_path))
    assert len(res.rows) == 3
    first, *runs = runner.requests
    assert first.label == "warm-profile" and first.text == calib
    (profile,) = (tmp_path / "out" / "warm").glob("warm-*.profile")
    for req in runs:
        assert req.text == text
        items = dict(req.cache.items()) if req.cache is not None else {}
        if items.get("mode") == "off":
            assert "profile" not in items  # the full model has no cache
        else:
            assert items.get("profile") == str(profile), req.cache
    # the same folder cold is another configuration: refused, not mixed with the warm records
    with pytest.raises(HarnessError, match="different configuration"):
        run_sweep(SweepOptions(out=tmp_path / "out", model=model, text=text, grid=grid), ProfileFake(), _info(),
                  env=FakeEnv(tmp_path))
    meta = json.loads((tmp_path / "out" / "results.jsonl").read_text().splitlines()[0])
    assert meta["kind"] == "meta"


def test_cli_refuses_cold_for_a_policy_that_never_fetches(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["compare", "--policies", "fetch-all,substitute-all", "--cold", "--out", str(tmp_path / "c")])
    assert rc != 0 and "never fetches" in capsys.readouterr().err
    rc = main(["sweep", "--cold", "--warm-from", str(tmp_path), "--out", str(tmp_path / "s")])
    assert rc != 0 and "--cold and --warm-from" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "s").exists()


@pytest.mark.build
def test_warm_start_with_the_real_build(patched_build: Build, tmp_path: Path) -> None:
    """tinymoe (trained: skewed routing) at 25%: substitute-all keeps its first residency for the whole run, so its
    substituted share is one minus the resident experts' share of the calls; from the calibration text's profile it
    must be clearly lower than from experts 0..n-1."""
    from harness.orchestration.sweep import sweep
    from harness.parsers.gguf_model import read_model_info

    model = ROOT / "models/tinymoe-f16.gguf"
    grid = SweepGrid(rules=("fetch-all", "substitute-all"), admits=("off",), fractions=(0.25,))
    rates = {}
    for name, warm_from in (("cold", None), ("warm", ROOT / HELDOUT_DOCS)):
        res = sweep(SweepOptions(out=tmp_path / name, model=model, text=ROOT / HELDOUT, grid=grid, n_ctx=256,
                                 chunks=4, threads=2, warm_from=warm_from))
        rates[name] = {r.point.rule: r.substitution_rate for r in res.rows}
    assert rates["warm"]["substitute-all"] < rates["cold"]["substitute-all"] - 0.05, rates
    (profile,) = (tmp_path / "warm" / "warm").glob("warm-*.profile")
    lines = profile.read_text().splitlines()
    info = read_model_info(model)
    assert lines[0] == "moe-expert-profile 1" and len(lines) == 1 + info.n_moe_layers
    counts = np.array([int(x) for x in lines[1].split()[3:]])
    assert counts.size == info.n_expert and counts.sum() > 0
