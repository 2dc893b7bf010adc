"""The named cache configurations and miss rules (docs/expert-cache.md): the presets and keys are the engine's."""

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

# Miss rules (the `rule` key), for sweeps.
RULES = ("fetch-all", "threshold", "first-choice", "substitute-all", "drop")
FIRST_CHOICE_FETCHING = ("fetch-all", "threshold", "first-choice")  # rank 0 is always fetched


def check_policies(policies: Sequence[str]) -> None:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise HarnessError(f"unknown polic{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}: "
                           f"use {', '.join(KNOWN_POLICIES)}")
    if not policies:
        raise HarnessError("no policies to compare")


def policy_cache_spec(policy: str, mode: str, slots: int, stats: str | None) -> CacheSpec:
    """The cache spec of a named configuration (POLICIES) in `mode` with `slots` per layer."""
    items = POLICIES[policy]
    preset = dict(items).get("policy")
    extra = tuple((k, v) for k, v in items if k != "policy")
    return CacheSpec(mode, preset, slots, stats, extra)

