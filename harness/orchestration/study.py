"""`harness study`: re-test the study's findings (PAPER.md) on one model at one residency, and say which held.

Runs (each resumable, in its own folder under --out):
- `compare/`: quality only, in emulate mode on the same tokens: fetch-all, the 0.15 rule (LFU, no admission),
  substitute-all, first-choice, quality-first and speed-first;
- `sweep/`: thresholds and first-choice with and without admission, for the mass hypothesis;
- `topics/`: quality-first with and without admission on the topic-shift text;
- `frontier/`: every family of policies (ours, fetch-all, the anchors', upstream's CPU share, combinations) side
  by side at the residency and half of it (`harness frontier`): the table of the fewest bytes per token within
  +0.5% and +1% delta-PPL, and whether the presets are on the frontier.
- `composition/`: Experiment B (finding 3), `generation/`: the generation test (harness.orchestration.study_parts).
Findings tested (numbering as in PAPER.md):
1. quality loss is concentrated in heavily weighted substitutions: the 0.15 rule substitutes nearly as many
   calls as substitute-all but loses much less;
2. the mass hypothesis: Pearson r > 0 between substituted mass and delta-PPL (first choice always fetched);
3. at equal substituted mass, a few heavy substitutions hurt more than many light ones (harness.domain.composition);
4. background admission (beta 0.5) lowers perplexity, most right after topic changes;
5. quality-first lowers perplexity against the 0.15 rule; speed-first does not raise it significantly.
Verdicts are decided by the rules in `verdicts` (pure) from paired 95% CIs; speed claims are not tested
(no engine speed here) beyond the cost model's estimate, which is labelled as such.
"""

from __future__ import annotations

from dataclasses import replace

from harness.core.errors import HarnessError
from harness.core.records import ResultsFile, prepare_out_dir
from harness.core.sizes import Size
from harness.domain.catalogue import FIRST_CHOICE_FETCHING, STUDY_POLICIES, SWEEP_TAUS
from harness.domain.options import (
    CompareOptions,
    FrontierGrid,
    FrontierOptions,
    StudyOptions,
    SweepGrid,
    SweepOptions,
    TopicOptions,
)
from harness.domain.results import CompareResult, FrontierResult, StudyResult, SweepResult, TopicResult, Verdict
from harness.orchestration.compare import compare
from harness.orchestration.executor import Environment, Progress, no_progress
from harness.orchestration.frontier import frontier
from harness.orchestration.study_parts import composition_part, finding3, generation_part
from harness.orchestration.summary import load_nlls
from harness.orchestration.sweep import sweep
from harness.orchestration.topics import topic_shift
from harness.parsers.nll_dump import NllDump, read_nll_dump_file
from harness.stats.intervals import DeltaPPL, paired_delta_ppl
from harness.tools.requests import Runner


def _fmt(d: DeltaPPL) -> str:
    return f"{d.delta_pct:+.2f}% [95% CI {d.low:+.2f}, {d.high:+.2f}]"


def verdicts(res: CompareResult, pairs: dict[str, DeltaPPL], sw: SweepResult,
             topics: TopicResult | None) -> tuple[Verdict, ...]:
    """The decision rules, one per finding."""
    q = {r.config: r for r in res.quality}
    out: list[Verdict] = []

    # 1. substitute-all vs the 0.15 rule
    sa, rule = q.get("substitute-all"), q.get("rule-0.15")
    pair = pairs.get("substitute-all vs rule-0.15")
    if sa and rule and sa.delta and rule.delta and sa.cache and rule.cache and pair and \
            sa.cache.substitution_rate and rule.cache.substitution_rate is not None:
        sub_ratio = rule.cache.substitution_rate / sa.cache.substitution_rate
        concentrated = pair.low > 0 and rule.delta.delta_pct < sub_ratio * sa.delta.delta_pct
        out.append(Verdict("1. loss concentrated in heavily weighted substitutions", concentrated,
                           f"the 0.15 rule substitutes {rule.cache.substitution_rate:.1%} of calls against "
                           f"{sa.cache.substitution_rate:.1%} for substitute-all ({sub_ratio:.0%} as many), for "
                           f"{_fmt(rule.delta)} against {_fmt(sa.delta)} vs the full model; substitute-all vs the "
                           f"0.15 rule, paired: {_fmt(pair)}. Held if that pair's CI is above 0 and the rule's loss "
                           "shrinks more than its substitutions"))
    else:
        out.append(Verdict("1. loss concentrated in heavily weighted substitutions", None,
                           "missing runs or NLL dumps for substitute-all or the 0.15 rule"))

    # 2. mass hypothesis
    m = sw.mass
    if m.correlation is not None:
        c = m.correlation
        out.append(Verdict("2. mass hypothesis", c.low > 0,
                           f"Pearson r = {c.r:.3f} [95% CI {c.low:.3f}, {c.high:.3f}, Fisher z] over {c.n} policies "
                           "that always fetch the first choice (study: r ~ 0.92). Held if the CI is above 0"))
    else:
        out.append(Verdict("2. mass hypothesis", None, m.note))

    # 4. admission
    adm = pairs.get("quality vs rule-0.15")
    if adm is not None:
        text = f"quality-first (the 0.15 rule + admission at beta 0.5) vs the 0.15 rule alone, paired: {_fmt(adm)}"
        held: bool | None = adm.high < 0
        if topics is not None:
            eff = topics.rows[2]
            after = _fmt(eff.after_change) if eff.after_change else "no scored tokens"
            rest = _fmt(eff.elsewhere) if eff.elsewhere else "no scored tokens"
            text += (f"; on the topic-shift text, admission on vs off: after a change {after}, elsewhere {rest}")
            held = held and eff.after_change is not None and eff.after_change.high < 0
        out.append(Verdict("4. admission at beta 0.5 lowers perplexity, most after topic changes", held,
                           text + ". Held if the CIs (overall, and after changes when measured) are below 0"))
    else:
        out.append(Verdict("4. admission at beta 0.5", None, "missing runs for quality or the 0.15 rule"))

    # 5. quality-first and speed-first vs the 0.15 rule
    spd = pairs.get("speed vs rule-0.15")
    if adm is not None and spd is not None:
        qf, sf = q.get("quality"), q.get("speed")
        fetch = ""
        if qf and sf and rule and qf.cache and sf.cache and rule.cache:
            fetch = (f"; fetches per token: 0.15 rule {rule.cache.fetches_per_token:.2f}, quality-first "
                     f"{qf.cache.fetches_per_token:.2f}, speed-first {sf.cache.fetches_per_token:.2f} (time not "
                     "measured here)")
        out.append(Verdict("5. quality-first lowers PPL vs the 0.15 rule; speed-first costs no significant PPL",
                           adm.high < 0 and spd.low <= 0,
                           f"quality-first vs 0.15 rule {_fmt(adm)}; speed-first vs 0.15 rule {_fmt(spd)}{fetch}. "
                           "Held if the first CI is below 0 and the second does not lie above 0"))
    else:
        out.append(Verdict("5. quality-first and speed-first vs the 0.15 rule", None, "missing runs"))
    return tuple(out)


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
                               argv=opts.argv),
                progress, runner=runner, env=env)
    records = ResultsFile(c.results_path).read()
    nll, _ = load_nlls(records, runner.load_nll if runner else read_nll_dump_file)
    pairs = policy_pairs(nll, [("substitute-all", "rule-0.15"), ("quality", "rule-0.15"), ("speed", "rule-0.15")],
                         seed=opts.seed)
    grid = SweepGrid(rules=FIRST_CHOICE_FETCHING, taus=SWEEP_TAUS,
                     admits=("off", "0.5"), fractions=(opts.residency,))
    s = sweep(SweepOptions(out=opts.out / "sweep", model=c.options.model, text=c.options.text, grid=grid,
                           n_ctx=opts.n_ctx, chunks=opts.chunks, threads=opts.threads, seed=opts.seed,
                           argv=opts.argv), progress, runner=runner, env=env)
    t: TopicResult | None = None
    note = "not run (--no-topics)"
    if opts.topics:
        try:
            t = topic_shift(TopicOptions(out=opts.out / "topics", model=c.options.model, tokenizer=opts.tokenizer,
                                         fraction=opts.residency, n_ctx=opts.n_ctx, threads=opts.threads,
                                         argv=opts.argv), progress, runner=runner, env=env)
            note = ""
        except HarnessError as e:
            note = f"not run: {e}"
    fr: FrontierResult | None = None
    fnote = "not run (--no-frontier)"
    if opts.frontier:
        fr = frontier(FrontierOptions(out=opts.out / "frontier", model=c.options.model, text=c.options.text,
                                      grid=FrontierGrid(fractions=(opts.residency, opts.residency / 2)),
                                      n_ctx=opts.n_ctx, chunks=opts.chunks, threads=opts.threads, seed=opts.seed,
                                      argv=opts.argv), progress, runner=runner, env=env)
        fnote = ""
    comp, comp_note = composition_part(replace(opts, model=c.options.model, text=c.options.text), progress,
                                       runner=runner, env=env)
    gen, gen_note = generation_part(replace(opts, model=c.options.model), progress, env=env)
    vs = list(verdicts(c, pairs, s, t))
    vs.insert(2, finding3(comp, comp_note))  # after 1 and 2, before 4 and 5
    result = StudyResult(opts, c, pairs, s, t, note, tuple(vs), fr, fnote)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "report.md").write_text(render_study_markdown(result) + "\n" +
                                        study_parts_markdown(comp, comp_note, gen, gen_note))
    return result

