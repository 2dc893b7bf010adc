"""The study's verdict rules (docs/study-verdicts.md, fixed before the runs), pure: each takes numbers already
computed (paired deltas with their 95% CIs, rates, masses) and returns a Verdict held / did not hold /
inconclusive (None) with the evidence. Finding 3's Experiment B rule is harness.domain.composition.finding3_verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.core.errors import HarnessError
from harness.domain.composition import CalibStep, Composition
from harness.domain.finding import Verdict
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import Correlation, DeltaPPL, cluster_bootstrap_pearson, pearson_fisher

MATCH = 0.10  # two runs match in rate or mass when they differ by at most 10% of their mean
SPEED_MARGIN = 0.5  # finding 5b's equivalence margin, percentage points of delta-PPL
RANK_LO = 0.15  # the heavy non-first band's lower edge (the 0.15 rule's)

FINDING1 = "1. loss concentrated in the few heavily weighted substitutions"
RANK_WEIGHT = "1 and 3. weight, not rank: at equal mass, heavy non-first choices hurt more than light first choices"
FINDING2 = "2. mass hypothesis, by families"
FINDING4 = "4. admission at beta 0.5 lowers perplexity, most right after topic changes"
FINDING5 = "5. quality-first lowers PPL vs the 0.15 rule; speed-first costs no significant PPL and fetches less"


def fmt(d: DeltaPPL) -> str:
    return f"{d.delta_pct:+.2f}% [95% CI {d.low:+.2f}, {d.high:+.2f}]"


def gap(a: float | None, b: float | None) -> float | None:
    """|a - b| / their mean; None when either is missing or the mean is 0."""
    if a is None or b is None:
        return None
    mean = (a + b) / 2
    return abs(a - b) / mean if mean > 0 else None


def matched(a: float | None, b: float | None, tolerance: float = MATCH) -> bool:
    g = gap(a, b)
    return g is not None and g <= tolerance


def above(d: DeltaPPL, bound: float) -> bool | None:
    """True if d's CI lies above `bound`, False if it lies below it, None if it contains it."""
    return True if d.low > bound else False if d.high < bound else None


def _all(parts: Sequence[bool | None]) -> bool | None:
    """Held if every part passed; did not hold if any failed; inconclusive otherwise."""
    if any(p is False for p in parts):
        return False
    return True if all(p is True for p in parts) else None


@dataclass(frozen=True)
class Arm:
    """One run on the evaluation tokens: its substitution rate and mean substituted mass per token-layer."""

    name: str
    rate: float | None
    mass: float | None


@dataclass(frozen=True)
class MatchedResult:
    calib_text: str  # where the calibration slice came from
    rule: Composition | None  # the 0.15 rule on the evaluation tokens
    lightest_hi: float | None
    rate_steps: tuple[CalibStep, ...]  # (H, substitution rate) of the search
    lightest: Composition | None
    q: DeltaPPL | None  # the rule against lightest-first
    heavy_nonfirst: Composition | None
    light_first_hi: float | None
    mass_steps: tuple[CalibStep, ...]
    light_first: Composition | None
    r: DeltaPPL | None  # heavy non-first against light first choices
    notes: tuple[str, ...] = ()
    dumps: tuple[tuple[str, NllDump], ...] = ()  # "matched:rule", ":lightest", ":heavy", ":light-first"


@dataclass(frozen=True)
class DomainRow:
    comparison: str  # "a vs b"
    whole: DeltaPPL
    by_domain: tuple[tuple[str, DeltaPPL | None], ...]

    @property
    def differs(self) -> tuple[str, ...]:
        """The domains whose CI lies on the other side of 0 from the whole text's (both excluding 0)."""
        if self.whole.low <= 0 <= self.whole.high:
            return ()
        pos = self.whole.low > 0
        return tuple(d for d, x in self.by_domain if x is not None and (x.high < 0 if pos else x.low > 0))


def arm(c: Composition | None) -> Arm | None:
    return None if c is None else Arm(c.name, c.substitution_rate, c.substituted_mass)


def finding1_verdict(rule: Arm, lightest: Arm | None, substitute_all: DeltaPPL | None, p_sa_rule: DeltaPPL | None,
                     q_rule_lightest: DeltaPPL | None, *, tolerance: float = MATCH) -> Verdict:
    """1a the counts match; 1b P's CI above S/2; 1c Q's CI high <= S/4 (fails when its low > S/4)."""
    rules = (f"Held if the 0.15 rule and lightest-first substitute the same share of calls (within {tolerance:.0%}), "
             "substitute-all vs the rule lies above half of substitute-all's loss, and the rule vs lightest-first "
             "does not exceed a quarter of it")
    if lightest is None or substitute_all is None or p_sa_rule is None or q_rule_lightest is None:
        return Verdict(FINDING1, None, "missing runs or NLL dumps (the 0.15 rule, substitute-all or lightest-first "
                                       "at the rule's count). " + rules)
    s = substitute_all.delta_pct
    text = (f"the 0.15 rule substitutes {_pct(rule.rate)} of calls, lightest-first {_pct(lightest.rate)}; "
            f"substitute-all vs the full model {fmt(substitute_all)} (S); substitute-all vs the rule {fmt(p_sa_rule)} "
            f"against S/2 = {s / 2:+.2f}; the rule vs lightest-first {fmt(q_rule_lightest)} against S/4 = "
            f"{s / 4:+.2f}")
    if not matched(rule.rate, lightest.rate, tolerance):
        g = gap(rule.rate, lightest.rate)
        return Verdict(FINDING1, None, text + ("; the counts do not match (" +
                                               (f"{g:.0%} apart" if g is not None else "no rate") + "). " + rules))
    b = above(p_sa_rule, s / 2)
    c = False if q_rule_lightest.low > s / 4 else True if q_rule_lightest.high <= s / 4 else None
    if q_rule_lightest.high < 0:
        text += "; the rule beats lightest-first at the same count (a rank effect)"
    return Verdict(FINDING1, _all((b, c)), text + ". " + rules)


def rank_weight_verdict(heavy_nonfirst: Arm | None, light_first: Arm | None, r: DeltaPPL | None, *,
                        tolerance: float = MATCH, note: str = "") -> Verdict:
    """R = heavy non-first vs light first choices at matched mass: held if R's CI > 0, not if < 0."""
    rules = (f"Held if, at masses matched within {tolerance:.0%}, heavy non-first vs light first choices lies above "
             "0; did not hold (the loss follows rank) if it lies below 0")
    if heavy_nonfirst is None or light_first is None or r is None:
        return Verdict(RANK_WEIGHT, None, (note or "missing runs or NLL dumps") + ". " + rules)
    text = (f"{heavy_nonfirst.name} substitutes {_pct(heavy_nonfirst.rate)} of calls at mass "
            f"{_num(heavy_nonfirst.mass)}, {light_first.name} {_pct(light_first.rate)} at mass "
            f"{_num(light_first.mass)}; heavy non-first vs light first choices {fmt(r)}")
    if not matched(heavy_nonfirst.mass, light_first.mass, tolerance):
        g = gap(heavy_nonfirst.mass, light_first.mass)
        return Verdict(RANK_WEIGHT, None, text + "; the masses do not match (" +
                       (f"{g:.0%} apart" if g is not None else "no mass") + "). " + rules)
    return Verdict(RANK_WEIGHT, above(r, 0.0), text + ". " + rules)


@dataclass(frozen=True)
class MassPoint:
    """A sweep point of a first-choice-fetching rule: its family (rule and tau), admission, mass and delta-PPL%."""

    family: str
    admit: str
    mass: float
    delta_pct: float


@dataclass(frozen=True)
class AdmissionPair:
    family: str
    mass_off: float
    mass_on: float
    delta_off: float
    delta_on: float
    on_vs_off: DeltaPPL | None  # paired, admission on against off

    @property
    def lowers_mass_raises_delta(self) -> bool:
        return self.mass_on < self.mass_off and self.delta_on > self.delta_off


@dataclass(frozen=True)
class DistinctMass:
    """Finding 2 on distinct policies: the groups (families merged when their masses match), their points, r."""

    groups: tuple[tuple[str, ...], ...]
    points: tuple[tuple[float, float], ...]  # (mass, delta-PPL%) per group
    correlation: Correlation | None
    note: str = ""


def distinct_policies(points: Sequence[MassPoint], *, tolerance: float = MATCH) -> DistinctMass:
    """Families (admission on and off averaged), then families whose masses match within `tolerance` merged (in
    order of mass, each joining the open group when it matches that group's first); r over the groups' means."""
    fam: dict[str, list[MassPoint]] = {}
    for p in points:
        fam.setdefault(p.family, []).append(p)
    means = sorted(((sum(p.mass for p in ps) / len(ps), sum(p.delta_pct for p in ps) / len(ps), name)
                    for name, ps in fam.items()))
    groups: list[list[tuple[float, float, str]]] = []
    for m in means:
        if groups and (m[0] == groups[-1][0][0] or matched(groups[-1][0][0], m[0], tolerance)):
            groups[-1].append(m)
        else:
            groups.append([m])
    pts = tuple((sum(x[0] for x in g) / len(g), sum(x[1] for x in g) / len(g)) for g in groups)
    names = tuple(tuple(x[2] for x in g) for g in groups)
    if len(pts) < 4:
        return DistinctMass(names, pts, None, f"{len(pts)} distinct policies: at least 4 are needed")
    try:
        return DistinctMass(names, pts, pearson_fisher([p[0] for p in pts], [p[1] for p in pts]))
    except HarnessError as e:  # constant mass or delta
        return DistinctMass(names, pts, None, str(e))


@dataclass(frozen=True)
class FamilyMass:
    """Finding 2 by families (docs/study-verdicts.md, "Finding 2 by families"): r over every first-choice-fetching
    run but fetch-all's, its CI by a cluster bootstrap over the families."""

    families: tuple[str, ...]
    n_points: int
    correlation: Correlation | None
    note: str = ""


EXACT_ANCHOR = "fetch-all"  # mass 0 and delta exactly 0 by construction: left out of finding 2's fit


def family_mass(points: Sequence[MassPoint], *, n_boot: int = 2000, seed: int = 0) -> FamilyMass:
    """Every point but the exact anchor's, clustered by family (admission on and off are two points of one)."""
    pts = [p for p in points if p.family != EXACT_ANCHOR]
    fams = tuple(dict.fromkeys(p.family for p in pts))
    if len(fams) < 4:
        return FamilyMass(fams, len(pts), None, f"{len(fams)} families: at least 4 are needed")
    try:
        return FamilyMass(fams, len(pts), cluster_bootstrap_pearson(
            [p.mass for p in pts], [p.delta_pct for p in pts], [p.family for p in pts], n_boot=n_boot, seed=seed))
    except HarnessError as e:  # constant mass or delta
        return FamilyMass(fams, len(pts), None, str(e))


def finding2_verdict(f: FamilyMass, pairs: Sequence[AdmissionPair] = (), distinct: DistinctMass | None = None,
                     all_points: Correlation | None = None) -> Verdict:
    """Held if at least 4 families and r's cluster-bootstrap CI low > 0; did not hold if r <= 0; inconclusive
    otherwise. The earlier rule's figures (`distinct`, `all_points`) are reported beside it."""
    rules = ("Held if r's CI (a cluster bootstrap over at least 4 families, fetch-all left out) lies above 0; did not "
             "hold if r <= 0")
    text = f"{len(f.families)} families, {f.n_points} points without fetch-all ({', '.join(f.families)})"
    held: bool | None = None
    if f.correlation is None:
        text += f": {f.note}"
    else:
        c = f.correlation
        text += f": Pearson r = {c.r:.3f} [95% CI {c.low:.3f}, {c.high:.3f}, {c.method}]"
        held = True if c.low > 0 else False if c.r <= 0 else None
    if distinct is not None:
        groups = "; ".join("+".join(g) for g in distinct.groups)
        text += f"; the earlier rule, {len(distinct.points)} distinct policies ({groups})"
        d = distinct.correlation
        text += (f": r = {d.r:.3f} [{d.low:.3f}, {d.high:.3f}, Fisher z, n = {d.n}]" if d is not None
                 else f": {distinct.note}")
    if all_points is not None:
        text += (f"; over all {all_points.n} points as if independent r = {all_points.r:.3f} "
                 f"[{all_points.low:.3f}, {all_points.high:.3f}]")
    if pairs:
        both = sum(p.lowers_mass_raises_delta for p in pairs)
        text += f"; admission lowers the mass and raises delta-PPL in {both} of {len(pairs)} pairs (" + "; ".join(
            f"{p.family}: mass {p.mass_off:.4f} -> {p.mass_on:.4f}, delta {p.delta_off:+.2f}% -> {p.delta_on:+.2f}%"
            + (f", on vs off {fmt(p.on_vs_off)}" if p.on_vs_off else "") for p in pairs) + ")"
    return Verdict(FINDING2, held, text + ". " + rules + " (study: r ~ 0.92)")


def finding4_verdict(a: DeltaPPL | None, after: DeltaPPL | None = None, elsewhere: DeltaPPL | None = None, *,
                     topics_run: bool = False) -> Verdict:
    """A = quality-first vs the 0.15 rule; after/elsewhere = admission on vs off on the topic-shift text."""
    rules = ("Held if quality-first vs the 0.15 rule lies below 0 and, with the topic text, admission on vs off "
             "after a change lies below 0 and below its effect elsewhere; did not hold if either lies above 0 or the "
             "effect after changes is not the larger")
    if a is None:
        return Verdict(FINDING4, None, "missing runs for quality-first or the 0.15 rule. " + rules)
    text = f"quality-first vs the 0.15 rule {fmt(a)} (study: -0.3 to -1.5%)"
    parts: list[bool | None] = [_below(a)]
    if topics_run:
        if after is None or elsewhere is None:
            text += "; on the topic-shift text, no scored tokens after a change or elsewhere"
            parts.append(None)
        else:
            text += f"; on the topic-shift text, admission on vs off: after a change {fmt(after)}, elsewhere " \
                    f"{fmt(elsewhere)}"
            b = _below(after)
            if b is True and not after.delta_pct < elsewhere.delta_pct:
                b = False
                text += " (not larger after changes)"
            parts.append(b)
    else:
        text += "; the topic-shift text was not run"
    return Verdict(FINDING4, _all(parts), text + ". " + rules)


def finding5_verdict(b: DeltaPPL | None, c: DeltaPPL | None, fetches_rule: float | None,
                     fetches_speed: float | None, *, margin: float = SPEED_MARGIN,
                     quality_vs_full: DeltaPPL | None = None, speed_vs_full: DeltaPPL | None = None) -> Verdict:
    """5a B = quality-first vs the rule below 0; 5b C = speed-first vs the rule: fails above 0 or not fewer
    fetches, passes with C's CI high <= margin and fewer fetches."""
    rules = (f"Held if quality-first vs the 0.15 rule lies below 0 and speed-first vs the rule has its CI high <= "
             f"{margin:g} points with fewer fetches per token; did not hold if the first lies above 0, the second "
             "above 0, or speed-first does not fetch less")
    if b is None or c is None:
        return Verdict(FINDING5, None, "missing runs for quality-first, speed-first or the 0.15 rule. " + rules)
    text = f"quality-first vs the 0.15 rule {fmt(b)}; speed-first vs the 0.15 rule {fmt(c)}"
    if fetches_rule is not None and fetches_speed is not None:
        text += f"; fetches per token (time not measured): the rule {fetches_rule:.2f}, speed-first {fetches_speed:.2f}"
    a5 = _below(b)
    fewer = None if fetches_rule is None or fetches_speed is None else fetches_speed < fetches_rule
    b5: bool | None = False if c.low > 0 or fewer is False else True if c.high <= margin and fewer else None
    if quality_vs_full is not None and speed_vs_full is not None:
        text += (f"; against the full model quality-first {fmt(quality_vs_full)}, speed-first {fmt(speed_vs_full)} "
                 "(study: +0.7 to +1.5%)")
    return Verdict(FINDING5, _all((a5, b5)), text + ". " + rules)


def _below(d: DeltaPPL) -> bool | None:
    """True if d's CI lies below 0, False if above, None if it contains 0."""
    a = above(d, 0.0)
    return None if a is None else not a


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.4f}"
