"""The policy catalogue: every named cache configuration and miss rule the harness knows, in one place.

The presets and keys are the engine's (docs/expert-cache.md). `compare`, `check`, `topics`, `study`, `simulate`
and the CLI's defaults and help all read their policy names from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.core.errors import HarnessError
from harness.tools.requests import CacheSpec

STOCK = "stock"  # stock llama.cpp (the stock build)
FULL = "full"  # the full model: the patched build with the cache off

# Named cache configurations: the three presets, and the bare miss rules with LFU eviction and no admission
# (the rules of the study's first finding; "rule-0.15" is "quality" without admission, so the two compare
# admission).
POLICIES: dict[str, tuple[tuple[str, str], ...]] = {
    "quality": (("policy", "quality"),),
    "speed": (("policy", "speed"),),
    "fetch-all": (("policy", "fetch-all"),),
    "rule-0.15": (("rule", "threshold"), ("tau", "0.15"), ("evict", "lfu"), ("admit", "off")),
    "first-choice": (("rule", "first-choice"), ("evict", "lfu"), ("admit", "off")),
    "substitute-all": (("rule", "substitute-all"), ("evict", "lfu"), ("admit", "off")),
    # the anchors at their defaults (docs/expert-cache.md, "The anchors' policies"): upstream llama.cpp's cache
    # (every miss fetched, ClassLRU), colibri's CACHE_ROUTE and DEGRADE_ZERO, ik_llama.cpp's SER (LFU, no admission)
    "upstream": (("rule", "fetch-all"), ("evict", "classlru"), ("admit", "off")),
    "cache-route": (("rule", "cache-route"), ("evict", "lfu"), ("admit", "off")),
    "zero": (("rule", "zero"), ("evict", "lfu"), ("admit", "off")),
    "ser": (("rule", "ser"), ("evict", "lfu"), ("admit", "off")),
    # from `harness frontier` on the trained model (eval/study-tinymoe/frontier/report.md): colibri's DEGRADE_ZERO
    # at tau 0.2, no renormalisation. At 25% residency it dominates both presets (point estimates: speed by -0.82%
    # [95% CI -1.31, -0.37] at no more estimated time, quality at equal delta with 59.5 against 332 KiB per token);
    # at 12.5% it is on the frontier at +1.32% against speed's +3.32%. The engine preset policy=drop-light.
    "drop-light": (("policy", "drop-light"),),
    # prefetch (issue 13 item 2) with the presets: the next MoE layer's router predicts its experts, admitted in the
    # background (on the trained model: quality's synchronous fetches 1.29 -> 0.70 per token, delta-PPL unchanged)
    "quality-prefetch": (("policy", "quality"), ("prefetch", "on")),
    "drop-light-prefetch": (("policy", "drop-light"), ("prefetch", "on")),
}
KNOWN_POLICIES = tuple(POLICIES)
DEFAULT_POLICIES = ("quality", "speed", "fetch-all")  # compare, check (a new baseline) and simulate
BASELINE_POLICY = "fetch-all"  # fetch every miss: never substitutes, the reference of speed-ups
# harness study: the rules of finding 1 and the two presets with admission (findings 4 and 5)
STUDY_POLICIES = ("fetch-all", "rule-0.15", "substitute-all", "first-choice", "quality", "speed")

# Miss rules (the `rule` key), for sweeps.
# the engine's rule table, in its order (tests/test_tables.py holds the two equal): cache-route, zero and ser are the
# anchors' rules, at their defaults (docs/expert-cache.md); band is Experiment B's; budget spends a per-token mass
RULES = ("fetch-all", "threshold", "first-choice", "substitute-all", "drop",
         "cache-route", "zero", "ser", "band", "budget")
SWEEP_RULES = ("fetch-all", "threshold", "first-choice", "substitute-all")  # harness sweep's default grid
FIRST_CHOICE_FETCHING = ("fetch-all", "threshold", "first-choice", "cache-route")  # rank 0 is always fetched (j=1)
SWEEP_TAUS = (0.05, 0.1, 0.15, 0.25, 0.4)  # thresholds of the threshold rule in a sweep


def check_policies(policies: Sequence[str]) -> None:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise HarnessError(f"unknown polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: "
                           f"use {', '.join(KNOWN_POLICIES)}")
    if not policies:
        raise HarnessError("no policies to compare")


def is_preset(policy: str) -> bool:
    """Is the named configuration one of the engine's presets (`policy=...`, with its own admission)?"""
    return "policy" in dict(POLICIES[policy])


def policy_cache_spec(policy: str, mode: str, slots: int, stats: str | None) -> CacheSpec:
    """The cache spec of a named configuration (POLICIES) in `mode` with `slots` per layer."""
    items = POLICIES[policy]
    preset = dict(items).get("policy")
    extra = tuple((k, v) for k, v in items if k != "policy")
    return CacheSpec(mode, preset, slots, stats, extra)


def policy_items(policy: str) -> tuple[tuple[str, str], ...]:
    """The spec keys of a named configuration (raises on an unknown name)."""
    if policy not in POLICIES:
        raise HarnessError(f"unknown policy {policy!r}: use {', '.join(POLICIES)}")
    return POLICIES[policy]


# harness frontier: the families of policies run side by side (each family's knobs over FrontierGrid), with what
# each stands for. The anchors' rules run with LFU eviction and no admission, as the bare rules of ours do, so that
# a family differs from ours by its rule alone; upstream's own cache is `fetch-all` with `classlru`, its CPU share
# is `host` (light=host, with classlru); `combos` are combinations of an anchor's idea with ours.
FRONTIER_FAMILIES: dict[str, str] = {
    "ours": "the threshold rule over tau and first-choice, with and without admission (LFU); the presets quality "
            "and speed run as presets",
    "fetch-all": "every miss fetched, evicting by LRU, LFU or ClassLRU (upstream llama.cpp's cache: fetch-all + "
                 "classlru)",
    "cache-route": "colibri's CACHE_ROUTE: ranks below j always computed, substitutes from the router's top m, "
                   "their weight scaled by alpha (LFU, no admission)",
    "zero": "colibri's DEGRADE_ZERO: misses below tau dropped, the rest fetched, renorm off/on (LFU)",
    "ser": "ik_llama.cpp's Smart Expert Reduction: the first kmin ranks run, a later one if its weight > t x rank "
           "0's, renorm off/on (LFU)",
    "host": "upstream's CPU share (light=host): the misses a rule does not fetch are computed on the host with the "
            "missed expert (exact), for first-choice, the 0.15 rule and substitute-all (classlru)",
    "combos": "combinations: a rank window with admission (cache-route + admit 0.5), the 0.15 rule with upstream's "
              "ClassLRU (admit 0.5), the 0.15 rule with host computes for its light misses (light=host)",
}
FRONTIER_FRACTIONS = (0.25, 0.125)  # the residencies of the side-by-side comparison
FRONTIER_BOUNDS = (0.5, 1.0)  # delta-PPL% bounds of the table "fewest bytes per token at <= bound"
FRONTIER_PRESETS = ("quality", "speed")  # the presets that must be on the frontier
