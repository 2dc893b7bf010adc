"""Experiment B (PAPER.md, finding 3): at equal substituted gate mass, does a few heavy substitutions hurt more than
many light ones? The options, the results, and the decision rule (pure).

Two compositions of the same cache (the same residency and eviction, no admission), each with the miss rule
`band` (docs/expert-cache.md), which substitutes a miss only when its gate weight lies in a band and fetches
every other miss, at any rank:
- heavy: `rule=band,lo=L`: only misses with gate weight >= L are substituted (few substitutions, each heavy);
- light: `rule=band,hi=H`: only misses with gate weight < H are substituted (many, each light), H <= L, so that
  the two bands do not overlap.
L is fixed per mass level; H is searched (bisection) on a calibration part of the text, apart from the evaluation
tokens, so that the light composition's substituted mass per token-layer equals the heavy one's. On the
evaluation tokens both run with the full model (cache off), and the heavy composition is paired against the light
one (delta-PPL, block bootstrap over chunks).

The decision rule, fixed before the runs (`finding3_verdict`):
- held if, at every mass level, the realised masses on the evaluation tokens match (|m_heavy - m_light| <= the
  tolerance times their mean; 10% unless told), the heavy composition substitutes fewer calls than the light one,
  and the paired delta-PPL of heavy against light has its 95% CI above 0;
- did not hold if at every level the masses match and the heavy composition substitutes fewer calls, but at some
  level the CI does not lie above 0;
- inconclusive (None) otherwise: a level whose masses differ beyond the tolerance (the study's own outcome: its
  realised masses were too low to compare), a light band that cannot reach the heavy mass below L, or a run or
  NLL dump missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.domain.finding import Verdict
from harness.domain.settings import PerplexitySettings
from harness.stats.intervals import DeltaPPL

FINDING3 = "3. at equal mass, a few heavy substitutions hurt more than many light ones"
MASS_TOLERANCE = 0.10  # relative: |m_heavy - m_light| <= 10% of their mean
HEAVY_LOS = (0.3, 0.5)  # the heavy bands' lower edges, one mass level each


@dataclass(frozen=True)
class CompositionOptions(PerplexitySettings):
    """`text` None: eval/data/heldout.txt. The evaluation runs score its first `chunks` chunks; the calibration
    runs score `calib_chunks` chunks of the characters from `calib_offset` on (written to calibration.txt)."""

    out: Path
    model: Path | None = None
    chunks: int | None = field(default=32, kw_only=True)
    residency: float = 0.25
    heavy_los: tuple[float, ...] = HEAVY_LOS
    tolerance: float = MASS_TOLERANCE
    calib_offset: int = 150_000
    calib_chars: int = 50_000
    calib_chunks: int = 8
    calib_text: Path | None = None  # the calibration slice from this file (from calib_offset) instead of the text
    max_steps: int = 8  # bisection steps for the light band's edge
    evict: str = "lfu"
    n_boot: int = 2000
    seed: int = 0
    argv: tuple[str, ...] = ()


@dataclass(frozen=True)
class CalibStep:
    hi: float
    mass: float


@dataclass(frozen=True)
class Composition:
    """One composition on the evaluation tokens."""

    name: str  # e.g. "heavy lo=0.3"
    spec: str  # the rule's keys, e.g. "rule=band,lo=0.3"
    ppl: float
    delta: DeltaPPL | None  # against the full model
    substituted_mass: float | None  # mean per token-layer
    substitution_rate: float | None
    subst_first_choice: int | None  # first choices substituted (heavy misses are mostly rank 0)
    max_subst_weight: float | None


@dataclass(frozen=True)
class MassLevel:
    """One mass level: the heavy band's edge L, the light band's edge H found on the calibration text."""

    heavy_lo: float
    calib_heavy_mass: float | None
    light_hi: float | None  # None: no edge <= L reaches the heavy mass
    calib_steps: tuple[CalibStep, ...]
    heavy: Composition | None
    light: Composition | None
    pair: DeltaPPL | None  # heavy against light, paired on the evaluation tokens
    note: str = ""

    @property
    def mass_gap(self) -> float | None:
        """|m_heavy - m_light| / their mean on the evaluation tokens."""
        if self.heavy is None or self.light is None or self.heavy.substituted_mass is None or \
                self.light.substituted_mass is None:
            return None
        a, b = self.heavy.substituted_mass, self.light.substituted_mass
        mean = (a + b) / 2
        return abs(a - b) / mean if mean > 0 else None


@dataclass(frozen=True)
class CompositionResult:
    options: CompositionOptions
    full_ppl: float | None
    slots: int
    levels: tuple[MassLevel, ...]
    verdict: Verdict
    results_path: Path
    warnings: tuple[str, ...] = ()


def _fmt(d: DeltaPPL) -> str:
    return f"{d.delta_pct:+.2f}% [95% CI {d.low:+.2f}, {d.high:+.2f}]"


def finding3_verdict(levels: Sequence[MassLevel], tolerance: float = MASS_TOLERANCE) -> Verdict:
    """The decision rule of the module docstring, over the mass levels."""
    rule = (f"Held if at every level the realised masses match within {tolerance:.0%} of their mean, the heavy "
            "composition substitutes fewer calls, and the paired CI of heavy vs light lies above 0; inconclusive when "
            "the masses do not match")
    if not levels:
        return Verdict(FINDING3, None, "no mass levels were run. " + rule)
    parts: list[str] = []
    inconclusive = False
    all_above = True
    for lv in levels:
        h, li = lv.heavy, lv.light
        if h is None or li is None or lv.pair is None or h.substituted_mass is None or li.substituted_mass is None \
                or h.substitution_rate is None or li.substitution_rate is None:
            parts.append(f"level lo={lv.heavy_lo:g}: {lv.note or 'runs or NLL dumps missing'}")
            inconclusive = True
            continue
        gap = lv.mass_gap
        text = (f"level lo={lv.heavy_lo:g} vs hi={lv.light_hi:g}: mass {h.substituted_mass:.4f} (heavy) vs "
                f"{li.substituted_mass:.4f} (light), substituted calls {h.substitution_rate:.1%} vs "
                f"{li.substitution_rate:.1%}, heavy vs light {_fmt(lv.pair)}")
        if gap is None or gap > tolerance:
            text += f"; masses differ by {gap:.0%} of their mean" if gap is not None else "; no mass"
            inconclusive = True
        elif not h.substitution_rate < li.substitution_rate:
            text += "; the heavy composition does not substitute fewer calls"
            inconclusive = True
        all_above = all_above and lv.pair.low > 0
        parts.append(text)
    held: bool | None = None if inconclusive else all_above
    return Verdict(FINDING3, held, "; ".join(parts) + ". " + rule)
