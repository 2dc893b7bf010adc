"""The policy catalogue: every named cache configuration and miss rule the harness knows, in one place.

The presets and keys are the engine's (docs/expert-cache.md). `compare`, `check`, `topics`, `study`, `simulate`
and the CLI's defaults and help all read their policy names from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.core.errors import HarnessError
from harness.tools.runners import CacheSpec

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
}
KNOWN_POLICIES = tuple(POLICIES)
DEFAULT_POLICIES = ("quality", "speed", "fetch-all")  # compare, check (a new baseline) and simulate
BASELINE_POLICY = "fetch-all"  # fetch every miss: never substitutes, the reference of speed-ups
# harness study: the rules of finding 1 and the two presets with admission (findings 4 and 5)
STUDY_POLICIES = ("fetch-all", "rule-0.15", "substitute-all", "first-choice", "quality", "speed")

# Miss rules (the `rule` key), for sweeps.
RULES = ("fetch-all", "threshold", "first-choice", "substitute-all", "drop",
         "cache-route", "zero", "ser")  # the last three: the anchors' rules, at their defaults (docs/expert-cache.md)
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
