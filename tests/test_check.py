"""harness.orchestration.check: the regression gate (pure cases by hand) and the command with a fake runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_compare import FakeEnv, FakeRunner

from harness.core.errors import HarnessError
from harness.orchestration.check import CheckOptions, check, gate
from harness.parsers.baseline import Baseline, read_baseline


def _setup(tmp_path: Path, synth: Path) -> CheckOptions:
    text = tmp_path / "t.txt"
    text.write_text("text")
    return CheckOptions(baseline=tmp_path / "baseline.json", out=tmp_path / "out", model=synth, text=text,
                        policies=("quality", "speed"), tolerance_pct=0.5)


def test_update_writes_a_baseline_and_the_same_run_passes(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    opts = _setup(tmp_path, synth_models["qwen3moe"])
    with pytest.raises(HarnessError, match="create it with --update"):
        check(opts, runner=FakeRunner(), env=FakeEnv(tmp_path), root=tmp_path)
    up = check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path),
               root=tmp_path)
    assert up.updated and up.passed
    doc = json.loads(opts.baseline.read_text())
    assert doc["schema"] == "moe-subst/ppl-baseline" and set(doc["policies"]) == {"quality", "speed"}
    assert doc["text"] == "t.txt" and doc["tolerance_pct"] == 0.5
    base = read_baseline(opts.baseline)
    assert base.policies["speed"]["delta_pct"] == pytest.approx(100 * (2.718281828459045 ** 0.05 - 1))
    again = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "out2"}), runner=FakeRunner(),
                  env=FakeEnv(tmp_path), root=tmp_path)
    assert again.passed and not again.updated and len(again.lines) == 3


def test_a_worse_policy_fails_the_gate(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    opts = _setup(tmp_path, synth_models["qwen3moe"])
    check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path),
          root=tmp_path)

    class Worse(FakeRunner):
        SHIFT = {**FakeRunner.SHIFT, "speed": 0.06}  # +6.18% instead of +5.13%: beyond the 0.5-point tolerance

    res = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "o2"}), runner=Worse(), env=FakeEnv(tmp_path),
                root=tmp_path)
    assert not res.passed
    bad = [ln for ln in res.lines if not ln.ok]
    assert [ln.policy for ln in bad] == ["speed"] and "REGRESSION" in bad[0].message


def _base(delta: float, tol: float = 0.5) -> Baseline:
    return Baseline("m.gguf", "t.txt", 256, 12, tol, 10.0, {"quality": {"delta_pct": delta, "low": 0, "high": 0}})


def test_gate_rule_by_hand(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    opts = _setup(tmp_path, synth_models["qwen3moe"])
    res = check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path),
                root=tmp_path).compare
    q = next(x for x in res.quality if x.config == "quality")
    assert q.delta is not None
    d = q.delta.delta_pct  # the fake's quality shift: a constant 0.001 nats, so the CI is [d, d]
    full = next(x for x in res.quality if x.config == "full").ppl
    def one(delta: float, low: float, high: float, scale: float = 0.5) -> Baseline:
        return Baseline("m", "t", 256, 12, 0.5, full, {"quality": {"delta_pct": delta, "low": low, "high": high}},
                        scale)

    # the band: [low - (scale * width + 0.5), high + (scale * width + 0.5)]
    assert all(ln.ok for ln in gate(one(d - 0.499, d - 0.499, d - 0.499), res))  # just within the floor
    assert [ln.ok for ln in gate(one(d - 0.51, d - 0.51, d - 0.51), res)] == [True, False]  # worse
    assert [ln.ok for ln in gate(one(d + 0.51, d + 0.51, d + 0.51), res)] == [True, False]  # better: also fails
    # a wide baseline interval widens the band by half its width: 1.0 wide -> 0.5 + 0.5 on each side
    assert all(ln.ok for ln in gate(one(d - 1.4, d - 1.9, d - 0.9), res))
    assert not all(ln.ok for ln in gate(one(d - 1.6, d - 2.1, d - 1.1), res))
    assert all(ln.ok for ln in gate(one(d - 1.6, d - 2.1, d - 1.1, scale=1.0), res))
    other_cpu = Baseline("m", "t", 256, 12, 0.5, full * (1 + 2e-6), {})  # another CPU's kernels: passes
    assert all(ln.ok for ln in gate(other_cpu, res))
    changed = Baseline("m", "t", 256, 12, 0.5, full * 1.001, {})
    (line,) = gate(changed, res)
    assert not line.ok and "model, text or build changed" in line.message
    missing = Baseline("m", "t", 256, 12, 0.5, full, {"rule-0.15": {"delta_pct": 0.0, "low": 0.0, "high": 0.0}})
    assert "no paired delta" in gate(missing, res)[1].message


def test_damaged_baselines(tmp_path: Path) -> None:
    p = tmp_path / "b.json"
    p.write_text("{")
    with pytest.raises(HarnessError, match="not JSON"):
        read_baseline(p)
    p.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(HarnessError, match="not a moe-subst/ppl-baseline"):
        read_baseline(p)
    p.write_text(json.dumps({**_base(1.0).to_json(), "full_ppl": "x"}))
    with pytest.raises(HarnessError, match="damaged baseline"):
        read_baseline(p)
    p.write_text(json.dumps(_base(1.0).to_json()))
    assert read_baseline(p) == _base(1.0)


class _Planted(FakeRunner):
    """The fake runner with a policy's per-token shift and its substitution figures changed."""

    def __init__(self, shift: dict[str, float], rate: float = 0.1, mass: float = 0.02) -> None:
        super().__init__()
        self.SHIFT = {**FakeRunner.SHIFT, **shift}
        self.rate, self.mass = rate, mass

    def perplexity(self, build, req):  # type: ignore[no-untyped-def]
        run = super().perplexity(build, req)
        if run.cache_stats is None or req.label != "quality":
            return run
        from dataclasses import replace
        return replace(run, cache_stats=replace(run.cache_stats, substitution_rate=self.rate,
                                                substituted_mass=self.mass))


def test_planted_regressions_fail_the_gate(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    """The two regressions of issue 22: the quality preset 2.3x worse, and a preset that stopped substituting."""
    opts = CheckOptions(**{**_setup(tmp_path, synth_models["qwen3moe"]).__dict__, "tolerance_pct": 0.05})
    up = check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path),
               root=tmp_path)
    assert up.passed
    doc = json.loads(opts.baseline.read_text())
    assert doc["schema_version"] == 2 and doc["policies"]["quality"]["substitution_rate"] == 0.1
    same = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "same"}), runner=_Planted({}),
                 env=FakeEnv(tmp_path), root=tmp_path)
    assert same.passed

    def run(runner: FakeRunner, out: str) -> list[str]:
        res = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / out}), runner=runner, env=FakeEnv(tmp_path),
                    root=tmp_path)
        assert not res.passed
        return [ln.message for ln in res.lines if not ln.ok]

    (worse,) = run(_Planted({"quality": 0.0023}), "worse")  # +0.23% instead of +0.10%
    assert "worse than the baseline's band" in worse
    (stopped,) = run(_Planted({"quality": 0.0}, rate=0.0, mass=0.0), "stopped")  # delta 0: no substitution
    assert "better than the baseline's band" in stopped and "substitution rate 0.0000" in stopped
    # the same delta but substituting a third fewer calls: the substitution figures alone catch it
    (fewer,) = run(_Planted({}, rate=0.066, mass=0.02), "fewer")
    assert "substitution rate" in fewer and "band" not in fewer


def test_a_version_1_baseline_is_read_and_skips_the_substitution_checks(tmp_path: Path) -> None:
    p = tmp_path / "b.json"
    doc = _base(1.0).to_json()
    doc.pop("tolerance_scale")
    p.write_text(json.dumps({**doc, "schema_version": 1}))
    b = read_baseline(p)
    assert b.schema_version == 1 and b.tolerance_scale == 0.5


def test_update_of_a_version_1_baseline_takes_this_runs_tolerance(tmp_path: Path,
                                                                   synth_models: dict[str, Path]) -> None:
    """A version-1 tolerance meant the one-sided rule (beyond the CI); kept as the floor of the band, it would let a
    2x worse preset pass. A version-2 baseline keeps its own."""
    opts = CheckOptions(**{**_setup(tmp_path, synth_models["qwen3moe"]).__dict__, "tolerance_pct": 0.05})
    check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path), root=tmp_path)
    doc = json.loads(opts.baseline.read_text())
    opts.baseline.write_text(json.dumps({**doc, "schema_version": 1, "tolerance_pct": 0.5}))
    check(CheckOptions(**{**opts.__dict__, "update": True, "out": tmp_path / "u1"}), runner=FakeRunner(),
          env=FakeEnv(tmp_path), root=tmp_path)
    assert json.loads(opts.baseline.read_text())["tolerance_pct"] == 0.05
    opts.baseline.write_text(json.dumps({**doc, "tolerance_pct": 0.2}))
    check(CheckOptions(**{**opts.__dict__, "update": True, "out": tmp_path / "u2"}), runner=FakeRunner(),
          env=FakeEnv(tmp_path), root=tmp_path)
    assert json.loads(opts.baseline.read_text())["tolerance_pct"] == 0.2


@pytest.mark.parametrize(("edit", "message"), [
    ({"tolerance_pct": float("inf")}, "tolerance_pct is inf, not a number of percentage points in [0, 100]"),
    ({"tolerance_pct": float("nan")}, "tolerance_pct is nan, not a number of percentage points in [0, 100]"),
    ({"tolerance_pct": -0.5}, "tolerance_pct is -0.5, not a number"),
    ({"tolerance_pct": 1e308}, "tolerance_pct is 1e+308, not a number of percentage points in [0, 100]"),
    ({"tolerance_pct": 100.5}, "tolerance_pct is 100.5, not a number"),
    ({"tolerance_scale": 1e308}, "tolerance_scale is 1e+308, not a number of interval widths in [0, 10]"),
    ({"tolerance_scale": float("nan")}, "tolerance_scale is nan, not a number of interval widths"),
    ({"full_ppl": float("nan")}, "full_ppl is nan, not a finite perplexity > 0"),
    ({"full_ppl": 0.0}, "full_ppl is 0.0"),
    ({"policies": {"quality": {"delta_pct": float("-inf"), "low": 0, "high": 0}}},
     "policy quality's delta_pct is -inf, not a finite number"),
])
def test_a_baseline_that_cannot_gate_is_damaged(tmp_path: Path, edit: dict[str, object], message: str) -> None:
    p = tmp_path / "b.json"
    doc = {**_base(-50.0).to_json(), **edit}
    p.write_text(json.dumps(doc))  # writes Infinity and NaN, which Python's json reads back
    with pytest.raises(HarnessError) as e:
        read_baseline(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: damaged baseline: {message}") and "--update" in msg, msg


def test_an_infinite_tolerance_fails_the_gate_instead_of_passing(tmp_path: Path, synth_models: dict[str, Path],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a baseline with "tolerance_pct": Infinity passed a policy 50 points worse with exit 0; NaN and a
    negative tolerance were reported as regressions. Now the command stops with one line, exit 2."""
    from harness.cli.app import main

    opts = _setup(tmp_path, synth_models["qwen3moe"])
    check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path),
          root=tmp_path)
    doc = json.loads(opts.baseline.read_text())
    for key in ("delta_pct", "low", "high"):  # the policy is now 50 points worse than the baseline
        doc["policies"]["quality"][key] -= 50
    for tol in (float("inf"), float("nan"), -1.0, 1e308, 101.0):  # 1e308 passed the 50-point regression, exit 0
        opts.baseline.write_text(json.dumps({**doc, "tolerance_pct": tol}))
        with pytest.raises(HarnessError, match="damaged baseline: tolerance_pct"):
            check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "o2"}), runner=FakeRunner(),
                  env=FakeEnv(tmp_path), root=tmp_path)
        assert main(["check", "--baseline", str(opts.baseline), "--out", str(tmp_path / "o3")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("harness: error: ") and "damaged baseline" in err and "\n" not in err, err
    # a finite tolerance of the same baseline gates as before: the 50-point regression fails
    opts.baseline.write_text(json.dumps({**doc, "tolerance_pct": 0.5}))
    res = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "o4"}), runner=FakeRunner(),
                env=FakeEnv(tmp_path), root=tmp_path)
    assert not res.passed and "REGRESSION" in next(ln for ln in res.lines if ln.policy == "quality").message


@pytest.mark.parametrize("tol", [float("inf"), float("nan"), -0.1, 1e308, 100.01])
def test_update_refuses_a_tolerance_that_cannot_gate(tmp_path: Path, synth_models: dict[str, Path],
                                                     tol: float) -> None:
    opts = _setup(tmp_path, synth_models["qwen3moe"])
    runner = FakeRunner()
    with pytest.raises(HarnessError, match=r"--tolerance .* is not a number of percentage points in \[0, 100\]$"):
        check(CheckOptions(**{**opts.__dict__, "update": True, "tolerance_pct": tol}), runner=runner,
              env=FakeEnv(tmp_path), root=tmp_path)
    assert runner.calls == [] and not opts.baseline.exists()


def test_the_largest_tolerance_is_taken(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    """100 points is the bound itself: a baseline with it gates (the same run passes)."""
    opts = _setup(tmp_path, synth_models["qwen3moe"])
    up = check(CheckOptions(**{**opts.__dict__, "update": True, "tolerance_pct": 100.0}), runner=FakeRunner(),
               env=FakeEnv(tmp_path), root=tmp_path)
    assert up.passed and read_baseline(opts.baseline).tolerance_pct == 100.0


def test_report_md_is_the_gates(tmp_path: Path, synth_models: dict[str, Path]) -> None:
    """Before, report.md was the comparison's: titled "harness compare", a plan of stock and patched speed runs on a
    device budget that check never ran, and no verdict. Now it is the gate's: its title, what ran, the rule with the
    baseline's tolerances, and PASS/FAIL per gate and overall."""
    opts = _setup(tmp_path, synth_models["qwen3moe"])
    check(CheckOptions(**{**opts.__dict__, "update": True}), runner=FakeRunner(), env=FakeEnv(tmp_path),
          root=tmp_path)

    class Worse(FakeRunner):
        SHIFT = {**FakeRunner.SHIFT, "speed": 0.06}

    res = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "bad"}), runner=Worse(), env=FakeEnv(tmp_path),
                root=tmp_path)
    assert not res.passed
    md = (tmp_path / "bad" / "report.md").read_text()
    assert md.startswith("# harness check\n\n**FAIL**: 1 of 3 gates failed (speed)\n"), md[:200]
    assert "harness compare" not in md and "## Budget" not in md and "--n-cpu-moe" not in md
    assert "Perplexity only (no speed runs, no device budget)" in md
    assert "stock llama.cpp and 2 policies (quality, speed) in emulate mode" in md
    assert "widened on each side by 0.5 x its width + 0.5 points" in md
    gates = md.split("## Gates")[1].split("## Quality")[0]
    rows = {r.split(" | ")[0].lstrip("| "): r.split(" | ")[1] for r in gates.splitlines() if r.startswith("| ")}
    assert (rows["full"], rows["quality"], rows["speed"]) == ("PASS", "PASS", "FAIL")
    speed = next(ln for ln in res.lines if ln.policy == "speed")
    assert speed.band is not None and speed.delta_pct is not None and speed.delta_pct > speed.band[1]
    good = check(CheckOptions(**{**opts.__dict__, "out": tmp_path / "good"}), runner=FakeRunner(),
                 env=FakeEnv(tmp_path), root=tmp_path)
    assert good.passed
    assert (tmp_path / "good" / "report.md").read_text().startswith("# harness check\n\n**PASS**: all 3 gates passed")
