"""`harness study`: re-test the study's findings (PAPER.md) on one model at one residency, and say which held.

Runs (each resumable, in its own folder under --out):
- `compare/`: quality only, in emulate mode on the same tokens: fetch-all, the 0.15 rule (LFU, no admission),
  substitute-all, first-choice, quality-first and speed-first;
- `sweep/`: thresholds and first-choice with and without admission, for the mass hypothesis;
- `topics/`: quality-first with and without admission on the topic-shift text;
- `frontier/`: every family of policies (ours, fetch-all, the anchors', upstream's CPU share, combinations) side
  by side at the residency and half of it (`harness frontier`): the table of the fewest bytes per token within
  +0.5% and +1% delta-PPL, and whether the presets are on the frontier.
- `composition/`: Experiment B (finding 3), `generation/`: the generation test (harness.orchestration.study_parts);
- `matched/`: lightest-first at the 0.15 rule's count, and heavy non-first against light first choices at equal
  mass (harness.orchestration.study_matched).
Findings tested (numbering as in PAPER.md), by the rules fixed before the runs (docs/study-verdicts.md; pure in
harness.domain.verdicts), each held / did not hold / inconclusive:
1. the loss is concentrated in the few heavily weighted substitutions: substitute-all vs the 0.15 rule above half
   of substitute-all's loss, and the rule no worse than lightest-first at its count (within a quarter of it);
1 and 3. weight, not rank: at equal mass, heavy non-first choices hurt more than light first choices;
2. the mass hypothesis by families (a cluster bootstrap over families, fetch-all left out), admission pairs per tau;
3. at equal substituted mass, a few heavy substitutions hurt more than many light ones (harness.domain.composition);
4. background admission (beta 0.5) lowers perplexity, most right after topic changes;
5. quality-first lowers perplexity against the 0.15 rule; speed-first does not raise it beyond 0.5 points and fetches
   less.
Speed claims are not tested (no engine speed here) beyond fetches per token and the cost model's estimate, which
are labelled as such.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir
from harness.core.sizes import Size
from harness.domain.catalogue import FIRST_CHOICE_FETCHING, FULL, STUDY_POLICIES, SWEEP_TAUS
from harness.domain.finding import Verdict
from harness.domain.options import (
    CompareOptions,
    FrontierGrid,
    FrontierOptions,
    StudyOptions,
    SweepGrid,
    SweepOptions,
    TopicOptions,
)
from harness.domain.results import (
    CompareResult,
    FrontierResult,
    StudyResult,
    SweepResult,
    SweepRow,
    TopicResult,
)
from harness.domain.verdicts import (
    AdmissionPair,
    Arm,
    DomainRow,
    MassPoint,
    MatchedResult,
    arm,
    distinct_policies,
    family_mass,
    finding1_verdict,
    finding2_verdict,
    finding4_verdict,
    finding5_verdict,
    rank_weight_verdict,
)
from harness.orchestration.compare import compare
from harness.orchestration.executor import Environment, Progress, no_progress
from harness.orchestration.frontier import frontier
from harness.orchestration.study_domains import study_domain_rows
from harness.orchestration.study_matched import matched_part
from harness.orchestration.study_parts import composition_part, finding3, generation_part
from harness.orchestration.summary import load_nlls
from harness.orchestration.sweep import sweep
from harness.orchestration.topics import topic_shift
from harness.parsers.nll_dump import NllDump, read_nll_dump_file
from harness.stats.intervals import DeltaPPL, paired_delta_ppl
from harness.tools.requests import Runner


def mass_points(rows: Sequence[SweepRow]) -> list[MassPoint]:
    """Finding 2's points: the sweep's first-choice-fetching policies, each in its family (rule and tau)."""
    return [MassPoint(_family(r), r.point.admit, r.substituted_mass, r.delta.delta_pct) for r in rows
            if r.point.rule in FIRST_CHOICE_FETCHING and r.delta is not None and r.substituted_mass is not None]


def _family(r: SweepRow) -> str:
    return r.point.rule + (f" tau={r.point.tau:g}" if r.point.tau is not None else "")


def admission_pairs(rows: Sequence[SweepRow], nll: dict[str, NllDump], *, seed: int = 0) -> tuple[
        AdmissionPair, ...]:
    """Per family, admission off against on (the first admitting point): masses, deltas, and the paired delta of
    on against off when both NLL dumps are there."""
    out: list[AdmissionPair] = []
    fams: dict[str, list[SweepRow]] = {}
    for r in rows:
        if r.point.rule in FIRST_CHOICE_FETCHING and r.delta is not None and r.substituted_mass is not None:
            fams.setdefault(_family(r), []).append(r)
    for fam, rs in fams.items():
        off = next((r for r in rs if r.point.admit == "off"), None)
        on = next((r for r in rs if r.point.admit != "off"), None)
        if off is None or on is None or off.delta is None or on.delta is None or off.substituted_mass is None \
                or on.substituted_mass is None:
            continue
        pair = policy_pairs(nll, [(on.point.name, off.point.name)], seed=seed).get(
            f"{on.point.name} vs {off.point.name}")
        out.append(AdmissionPair(fam, off.substituted_mass, on.substituted_mass, off.delta.delta_pct,
                                 on.delta.delta_pct, pair))
    return tuple(out)


def verdicts(res: CompareResult, pairs: dict[str, DeltaPPL], sw: SweepResult, topics: TopicResult | None,
             matched: MatchedResult | None = None, adm_pairs: Sequence[AdmissionPair] = ()) -> tuple[Verdict, ...]:
    """The pre-registered rules (docs/study-verdicts.md, harness.domain.verdicts), one per finding, in order:
    1, rank against weight, 2, 4, 5 (the study inserts 3, Experiment B's, after 2)."""
    q = {r.config: r for r in res.quality}
    rule, sa = q.get("rule-0.15"), q.get("substitute-all")
    rule_arm = (arm(matched.rule) if matched is not None and matched.rule is not None else
                Arm("the 0.15 rule", rule.cache.substitution_rate if rule and rule.cache else None,
                    rule.cache.substituted_mass if rule and rule.cache else None))
    assert rule_arm is not None
    f1 = finding1_verdict(rule_arm, arm(matched.lightest) if matched else None, sa.delta if sa else None,
                          pairs.get("substitute-all vs rule-0.15"), matched.q if matched else None)
    rw = rank_weight_verdict(arm(matched.heavy_nonfirst) if matched else None,
                             arm(matched.light_first) if matched else None, matched.r if matched else None,
                             note="; ".join(matched.notes) if matched and matched.notes else "")
    pts = mass_points(sw.rows)
    f2 = finding2_verdict(family_mass(pts), adm_pairs, distinct_policies(pts), sw.mass.correlation)
    a = pairs.get("quality vs rule-0.15")
    eff = topics.rows[2] if topics is not None and len(topics.rows) > 2 else None
    f4 = finding4_verdict(a, eff.after_change if eff else None, eff.elsewhere if eff else None,
                          topics_run=topics is not None)
    qf, sf = q.get("quality"), q.get("speed")
    f5 = finding5_verdict(a, pairs.get("speed vs rule-0.15"),
                          rule.cache.fetches_per_token if rule and rule.cache else None,
                          sf.cache.fetches_per_token if sf and sf.cache else None,
                          quality_vs_full=qf.delta if qf else None, speed_vs_full=sf.delta if sf else None)
    return f1, rw, f2, f4, f5


def header_lines(text: Path, chunks: int | None, n_ctx: int, d: DeltaPPL | None) -> tuple[str, ...]:
    """The report header's text lines: which chunks, and the text's domains when `<stem>-sources.json` lists them
    (eval/data/heldout-sources.json: each document's domain and length, joined by one newline)."""
    which = "every chunk (the whole text)" if chunks is None else f"the first {chunks} chunks"
    line = f"Chunks: {which} of {n_ctx} tokens"
    if d is not None:
        line += f", {d.n_chunks} chunks, {d.n_tokens} scored tokens"
    out = [line + "."]
    src = text.with_name(f"{text.stem}-sources.json")
    if src.is_file():
        try:
            docs = json.loads(src.read_text())
            total = sum(int(x["chars"]) for x in docs)
            by: dict[str, list[int]] = {}
            for x in docs:
                v = by.setdefault(str(x["domain"]), [0, 0])
                v[0] += 1
                v[1] += int(x["chars"])
            out.append("Domains of the text, in order (" + src.name + "): " + ", ".join(
                f"{k} {n} documents, {c} characters ({c / total:.0%})" for k, (n, c) in by.items()) +
                ("" if chunks is None else "; the first chunks cover the first domain(s) only") + ".")
        except (ValueError, KeyError, TypeError) as e:
            out.append(f"Domains: {src.name} unreadable ({e}).")
    return tuple(out)


DOMAIN_PAIRS = (("substitute-all vs rule-0.15 (1b: P)", "rule-0.15", "substitute-all"),
                ("rule-0.15 vs lightest-first (1c: Q)", "matched:lightest", "matched:rule"),
                ("heavy non-first vs light first choices (R)", "matched:light-first", "matched:heavy"),
                ("quality vs rule-0.15 (4, 5: A)", "rule-0.15", "quality"),
                ("speed vs rule-0.15 (5: C)", "rule-0.15", "speed"),
                *((f"{p} vs full", FULL, p) for p in STUDY_POLICIES))


# which per-domain comparisons each finding's rule reads (by the tag in DOMAIN_PAIRS' names)
_FINDING_TAGS = {"1.": ("(1b: P)", "(1c: Q)"), "1 and 3.": ("(R)",), "4.": ("(4, 5: A)",),
                 "5.": ("(4, 5: A)", "(5: C)")}


def with_domains(v: Verdict, rows: Sequence[DomainRow]) -> Verdict:
    """The verdict with "differs by domain" added where one of its comparisons has a domain across 0 from the whole
    text's (docs/study-verdicts.md)."""
    tags = next((t for k, t in _FINDING_TAGS.items() if v.finding.startswith(k)), ())
    hits = [f"{r.comparison}: {', '.join(r.differs)}" for r in rows if r.differs and r.comparison.endswith(tags)] \
        if tags else []
    return replace(v, evidence=v.evidence + "; differs by domain (" + "; ".join(hits) + ")") if hits else v


def policy_pairs(nll: dict[str, NllDump], pairs: list[tuple[str, str]], *, seed: int = 0) -> dict[str, DeltaPPL]:
    out: dict[str, DeltaPPL] = {}
    for a, b in pairs:
        if a in nll and b in nll and nll[a].nll.shape == nll[b].nll.shape:
            out[f"{a} vs {b}"] = paired_delta_ppl(nll[b].nll, nll[a].nll, nll[b].chunk, seed=seed)
    return out


def study(opts: StudyOptions, progress: Progress = no_progress, *, runner: Runner | None = None,
          env: Environment | None = None) -> StudyResult:
    """Run (or resume) the three parts and decide the verdicts; writes report.md in opts.out."""
    from harness.report.markdown import render_study_markdown
    from harness.report.study_parts import study_parts_markdown

    if not 0 < opts.residency <= 1:
        raise HarnessError(f"the residency must be in (0, 100]%, got {opts.residency * 100:g}%")
    prepare_out_dir(opts.out)
    c = compare(CompareOptions(out=opts.out / "compare", model=opts.model, text=opts.text, policies=STUDY_POLICIES,
                               vram=Size(fraction=opts.residency), n_ctx=opts.n_ctx,
                               chunks=opts.chunks, threads=opts.threads, speed=False, seed=opts.seed,
                               argv=opts.argv, warm_from=opts.warm_from),
                progress, runner=runner, env=env)
    records = ResultsFile(c.results_path).read()
    nll, _ = load_nlls(records, runner.load_nll if runner else read_nll_dump_file)
    pairs = policy_pairs(nll, [("substitute-all", "rule-0.15"), ("quality", "rule-0.15"), ("speed", "rule-0.15")],
                         seed=opts.seed)
    grid = SweepGrid(rules=FIRST_CHOICE_FETCHING, taus=SWEEP_TAUS,
                     admits=("off", "0.5"), fractions=(opts.residency,))
    s = sweep(SweepOptions(out=opts.out / "sweep", model=c.options.model, text=c.options.text, grid=grid,
                           n_ctx=opts.n_ctx, chunks=opts.chunks, threads=opts.threads, seed=opts.seed,
                           argv=opts.argv, warm_from=opts.warm_from), progress, runner=runner, env=env)
    t: TopicResult | None = None
    note = "not run (--no-topics)"
    if opts.topics:
        try:
            t = topic_shift(TopicOptions(out=opts.out / "topics", model=c.options.model, tokenizer=opts.tokenizer,
                                         fraction=opts.residency, n_ctx=opts.n_ctx, threads=opts.threads,
                                         argv=opts.argv, warm_from=opts.warm_from), progress, runner=runner, env=env)
            note = ""
        except HarnessError as e:
            note = f"not run: {e}"
    fr: FrontierResult | None = None
    fnote = "not run (--no-frontier)"
    if opts.frontier:
        fr = frontier(FrontierOptions(out=opts.out / "frontier", model=c.options.model, text=c.options.text,
                                      grid=FrontierGrid(fractions=(opts.residency, opts.residency / 2)),
                                      n_ctx=opts.n_ctx, chunks=opts.chunks, threads=opts.threads, seed=opts.seed,
                                      argv=opts.argv, warm_from=opts.warm_from), progress, runner=runner, env=env)
        fnote = ""
    comp, comp_note = composition_part(replace(opts, model=c.options.model, text=c.options.text), progress,
                                       runner=runner, env=env)
    mt, mt_note = matched_part(replace(opts, model=c.options.model, text=c.options.text), progress, runner=runner,
                               env=env)
    gen, gen_note = generation_part(replace(opts, model=c.options.model), progress, env=env)
    sweep_nll, _ = load_nlls(ResultsFile(s.results_path).read(), runner.load_nll if runner else read_nll_dump_file)
    adm = admission_pairs(s.rows, sweep_nll, seed=opts.seed)
    vs = list(verdicts(c, pairs, s, t, mt, adm))
    vs.insert(3, finding3(comp, comp_note))  # after 1, rank against weight and 2; before 4 and 5
    assert c.options.text is not None
    head = header_lines(c.options.text, opts.chunks, opts.n_ctx, pairs.get("quality vs rule-0.15"))
    dom_nll = {**nll, **dict(mt.dumps if mt else ())}
    rows, dom_note = study_domain_rows(c.options.text, opts.tokenizer, dom_nll, DOMAIN_PAIRS, seed=opts.seed)
    vs = [with_domains(v, rows) for v in vs]
    result = StudyResult(opts, c, pairs, s, t, note, tuple(vs), fr, fnote, mt, mt_note, head, adm, rows, dom_note)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_study_markdown(result) + "\n" +
                                        study_parts_markdown(comp, comp_note, gen, gen_note))
    return result
