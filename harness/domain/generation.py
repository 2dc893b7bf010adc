"""The generation test (PAPER.md, "Limits"; issue 13, item 5): greedy generation under each cache policy against
the full model on a fixed prompt set. Options, results and the summary (pure).

Per policy and prompt kind (gsm8k: math word problems; humaneval: code stubs):
- tokens until the first divergence from the full model's generation (mean over prompts, bootstrap 95% CI);
- the share of prompts whose whole generation is identical (Wilson 95% CI);
- gsm8k: answer agreement, the share of prompts whose final number equals the full model's (Wilson 95% CI), over
  the prompts where the full model's generation has a number. This is agreement with the full model, not
  correctness: on a model that cannot do arithmetic it says nothing about accuracy;
- the substituted gate mass (mean over prompts of each prompt's mean per token-layer, prompt and generated tokens).
Across the policies that always fetch the first choice (the mass hypothesis' set): Pearson r of mass against mean
tokens until divergence, with a Fisher-z 95% CI; the prediction (more mass, earlier divergence) holds when the CI
lies below 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.core.errors import HarnessError
from harness.domain.catalogue import FIRST_CHOICE_FETCHING, FULL, POLICIES, STUDY_POLICIES
from harness.parsers.generation import final_number
from harness.stats.agreement import BootMean, Proportion, agreeing_prefix, bootstrap_mean, identical, wilson
from harness.stats.degeneration import degenerates
from harness.stats.intervals import Correlation, pearson_fisher
from harness.tools.datasets import PROMPT_KINDS, Prompt

# thresholds between the study's, for the mass-vs-agreement correlation (the rule-0.15 family)
EXTRA_POLICIES: dict[str, tuple[tuple[str, str], ...]] = {
    f"rule-{t:g}": (("rule", "threshold"), ("tau", f"{t:g}"), ("evict", "lfu"), ("admit", "off"))
    for t in (0.05, 0.1, 0.25, 0.4)
}
GENERATION_POLICIES = (*STUDY_POLICIES, *EXTRA_POLICIES)
DEFAULT_PROMPTS = Path("eval/data/gen-prompts.jsonl")


def generation_policy_items(name: str) -> tuple[tuple[str, str], ...]:
    if name in POLICIES:
        return POLICIES[name]
    if name in EXTRA_POLICIES:
        return EXTRA_POLICIES[name]
    raise HarnessError(f"unknown policy {name!r}: use {', '.join(GENERATION_POLICIES)}")


def fetches_first_choice(name: str) -> bool:
    """Does the policy always fetch a missed first choice (the set the mass hypothesis is about)?"""
    d = dict(generation_policy_items(name))
    rule = {"quality": "threshold", "speed": "first-choice", "fetch-all": "fetch-all"}.get(d.get("policy", ""),
                                                                                          d.get("rule", ""))
    return rule in FIRST_CHOICE_FETCHING


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    out: Path
    model: Path | None = None
    prompts: Path | None = None  # None: DEFAULT_PROMPTS (or --dataset)
    dataset: str | None = None  # gsm8k or humaneval: their prompts (network once), instead of --prompts
    limit: int | None = None  # the first N prompts
    policies: tuple[str, ...] = GENERATION_POLICIES
    n_predict: int = 48
    n_ctx: int = 512
    residency: float = 0.25
    threads: int | None = None
    n_boot: int = 2000
    seed: int = 0
    argv: tuple[str, ...] = ()


NOT_LOOPING = "not looping"  # the rows over the prompts whose full-model generation does not end in a loop


@dataclass(frozen=True)
class PromptOutcome:
    """One prompt under one policy, against the full model."""

    id: str
    kind: str
    n_ref: int  # the full model's generated tokens
    prefix: int  # tokens until the first divergence
    same: bool
    answer_ref: str | None  # gsm8k: the full model's final number
    answer: str | None
    mass: float | None


@dataclass(frozen=True)
class KindRow:
    policy: str
    kind: str  # one of PROMPT_KINDS, or "all"
    n: int
    prefix: BootMean
    same: Proportion
    answers: Proportion | None  # gsm8k (and all): over the prompts with a full-model answer
    mass: float | None


@dataclass(frozen=True)
class MassAgreement:
    kind: str
    correlation: Correlation | None
    n: int
    note: str = ""


@dataclass(frozen=True)
class Degeneration:
    """How many of the full model's generations of one kind end in a loop (harness.stats.degeneration)."""

    kind: str
    share: Proportion
    ids: tuple[str, ...]  # the prompts whose generation degenerates


def prompt_kinds(prompts: Sequence[Prompt]) -> list[str]:
    """The kinds present, in PROMPT_KINDS' order."""
    return [k for k in PROMPT_KINDS if any(p.kind == k for p in prompts)]


def degeneration(prompts: Sequence[Prompt], full: Mapping[str, Mapping[str, Any]]) -> tuple[Degeneration, ...]:
    """Per kind (and "all" when there are several): the full model's generations that degenerate."""
    bad = {p.id for p in prompts if p.id in full and degenerates(list(full[p.id]["tokens"]))}
    kinds = prompt_kinds(prompts)
    out = []
    for k in [*kinds, *(["all"] if len(kinds) > 1 else [])]:
        ps = [p for p in prompts if p.id in full and (k == "all" or p.kind == k)]
        ids = tuple(p.id for p in ps if p.id in bad)
        out.append(Degeneration(k, wilson(len(ids), len(ps)), ids))
    return tuple(out)


@dataclass(frozen=True)
class GenerationResult:
    options: GenerateOptions
    slots: int
    n_prompts: dict[str, int]  # per kind
    rows: tuple[KindRow, ...]
    mass_agreement: tuple[MassAgreement, ...]
    full_answers: int  # gsm8k prompts where the full model's generation has a number
    results_path: Path
    warnings: tuple[str, ...] = ()
    outcomes: dict[str, tuple[PromptOutcome, ...]] = field(default_factory=dict)
    degenerate: tuple[Degeneration, ...] = ()  # the full model's generations, per kind (and "all")


def outcomes(prompts: Sequence[Prompt], full: Mapping[str, Mapping[str, Any]],
             test: Mapping[str, Mapping[str, Any]]) -> tuple[PromptOutcome, ...]:
    """Per prompt: the test generation against the full model's. `full`/`test`: id -> {"tokens", "text", "mass"}."""
    out: list[PromptOutcome] = []
    for p in prompts:
        if p.id not in full or p.id not in test:
            raise HarnessError(f"prompt {p.id} is missing from a generation run")
        ref, got = full[p.id], test[p.id]
        r_tok, t_tok = list(ref["tokens"]), list(got["tokens"])
        is_math = p.kind == "gsm8k"
        out.append(PromptOutcome(p.id, p.kind, len(r_tok), agreeing_prefix(r_tok, t_tok), identical(r_tok, t_tok),
                                 final_number(str(ref["text"])) if is_math else None,
                                 final_number(str(got["text"])) if is_math else None,
                                 None if got.get("mass") is None else float(got["mass"])))
    return tuple(out)


def kind_row(policy: str, kind: str, items: Sequence[PromptOutcome], *, n_boot: int = 2000,
             seed: int = 0) -> KindRow:
    if not items:
        raise HarnessError(f"no prompts of kind {kind}")
    prefix = bootstrap_mean([o.prefix for o in items], n_boot=n_boot, seed=seed)
    same = wilson(sum(o.same for o in items), len(items))
    math = [o for o in items if o.kind == "gsm8k" and o.answer_ref is not None]
    answers = wilson(sum(o.answer == o.answer_ref for o in math), len(math)) if any(
        o.kind == "gsm8k" for o in items) else None
    masses = [o.mass for o in items if o.mass is not None]
    return KindRow(policy, kind, len(items), prefix, same, answers, sum(masses) / len(masses) if masses else None)


def summarize(prompts: Sequence[Prompt], runs: Mapping[str, Mapping[str, Mapping[str, Any]]],
              policies: Sequence[str], *, n_boot: int = 2000, seed: int = 0) -> tuple[
        tuple[KindRow, ...], tuple[MassAgreement, ...], dict[str, tuple[PromptOutcome, ...]]]:
    """Rows per policy and kind (and "all"), and mass vs agreement per kind. `runs`: config -> id -> generation;
    FULL must be among them."""
    if FULL not in runs:
        raise HarnessError("the full model's generations are missing")
    kinds = prompt_kinds(prompts)
    rows: list[KindRow] = []
    per: dict[str, tuple[PromptOutcome, ...]] = {}
    for pol in policies:
        if pol not in runs:
            continue
        per[pol] = outcomes(prompts, runs[FULL], runs[pol])
        for k in kinds:
            rows.append(kind_row(pol, k, [o for o in per[pol] if o.kind == k], n_boot=n_boot, seed=seed))
        if len(kinds) > 1:
            rows.append(kind_row(pol, "all", per[pol], n_boot=n_boot, seed=seed))
        # agreement is inflated by the full model's own loops (a policy that falls into the same loop agrees to the
        # end): the same rows over the prompts whose full-model generation does not loop
        looping = {p.id for p in prompts if degenerates(list(runs[FULL][p.id]["tokens"]))}
        clean = [o for o in per[pol] if o.id not in looping]
        if looping and clean:
            rows.append(kind_row(pol, NOT_LOOPING, clean, n_boot=n_boot, seed=seed))
    corr: list[MassAgreement] = []
    for k in [*kinds, *(["all"] if len(kinds) > 1 else [])]:
        pts = [(r.mass, r.prefix.mean) for r in rows
               if r.kind == k and r.mass is not None and fetches_first_choice(r.policy)]
        try:
            c = pearson_fisher([float(a) for a, _ in pts], [float(b) for _, b in pts])
            corr.append(MassAgreement(k, c, len(pts)))
        except HarnessError as e:
            corr.append(MassAgreement(k, None, len(pts), str(e)))
    return tuple(rows), tuple(corr), per
