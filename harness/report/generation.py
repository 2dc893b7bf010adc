"""Markdown of the generation test (`harness generate`): per policy and prompt kind, agreement with the full
model, and mass vs agreement. Pure."""

from __future__ import annotations

import math
from collections import Counter

from harness.domain.generation import NOT_LOOPING, GenerationResult, KindRow
from harness.report.tables import md_table, shown
from harness.stats.degeneration import MAX_PERIOD, MIN_SPAN

HEADER = ["policy", "prompts", "tokens until divergence [95% CI]", "identical [95% CI]",
          "answer agreement [95% CI]", "mass"]


def _share(k: int, n: int, lo: float, hi: float) -> str:
    if n == 0:
        return "-"
    return f"{k}/{n} = {k / n:.0%} [{lo:.0%}, {hi:.0%}]"


def row_cells(r: KindRow) -> list[str]:
    p = r.prefix
    prefix = f"{p.mean:.1f} [{p.low:.1f}, {p.high:.1f}]" if not math.isnan(p.low) else f"{p.mean:.1f}"
    ans = "-" if r.answers is None else _share(r.answers.k, r.answers.n, r.answers.low, r.answers.high)
    return [r.policy, str(r.n), prefix, _share(r.same.k, r.same.n, r.same.low, r.same.high), ans,
            f"{r.mass:.4f}" if r.mass is not None else "-"]


def generation_section(result: GenerationResult, heading: str = "##") -> list[str]:
    o = result.options
    file = shown(o.prompts) if o.prompts else "eval/data/gen-prompts.jsonl"
    src = f"--dataset {o.dataset}" if o.dataset else f"`{file}`"
    names = {"gsm8k": "math word problems (gsm8k)", "humaneval": "code stubs (humaneval)",
             "code": "beginnings of code files (code)", "prose": "beginnings of prose documents (prose)"}
    kinds = ", ".join(f"{n} {names.get(k, k)}" for k, n in result.n_prompts.items())
    answers = (f"Answer agreement: the final number of the generation equals the full model's, over the gsm8k "
               f"prompts where the full model's generation has a number ({result.full_answers} of "
               f"{result.n_prompts['gsm8k']}). It measures agreement with the full model, not correctness. "
               if result.n_prompts.get("gsm8k") else "")
    lines = [f"Prompts {src}: {kinds}; {o.n_predict} tokens each, greedy "
             f"(argmax), a fresh context per prompt; {result.slots} slots per layer, emulate mode, against the full "
             "model (cache off). Tokens until divergence: mean over prompts, percentile bootstrap 95% CI; shares: "
             f"Wilson 95% CI. {answers}"
             "Mass: mean substituted gate mass per token-layer (prompt and generated tokens), averaged over prompts.",
             ""]
    refs = Counter(o.answer_ref for o in next(iter(result.outcomes.values()), ()) if o.answer_ref is not None)
    if refs:
        lines += ["The full model's answers (final numbers, how often): "
                  + ", ".join(f"{a if len(a) <= 12 else a[:12] + '...'} x{n}" for a, n in refs.most_common())
                  + f"; {len(refs)} distinct among {sum(refs.values())}: the fewer distinct answers, the more "
                  "answer agreement happens by chance.", ""]
    for kind in [*result.n_prompts, "all", NOT_LOOPING]:
        rows = [r for r in result.rows if r.kind == kind]
        if rows:
            why = ([f"Over the {rows[0].n} prompts whose full-model generation does not end in a loop (below): a "
                    "policy that falls into the full model's loop agrees with it to the end, which inflates the "
                    "rows above.", ""] if kind == NOT_LOOPING else [])
            lines += [f"{heading}# {kind}", "", *why, md_table(HEADER, [row_cells(r) for r in rows]), ""]
    if result.degenerate:
        lines += [f"{heading}# The full model's generations: degenerate?", "",
                  "A generation degenerates when it ends in a loop: a suffix repeating with a period of at most "
                  f"{MAX_PERIOD} tokens over at least max({MIN_SPAN}, 3 periods) tokens (harness.stats.degeneration, "
                  "fixed before the trained models' runs). Wilson 95% CI.", ""]
        lines += [f"- {d.kind}: {_share(d.share.k, d.share.n, d.share.low, d.share.high)} degenerate"
                  + (f" ({', '.join(d.ids)})" if d.ids else "") for d in result.degenerate]
        lines.append("")
    lines += [f"{heading}# Mass vs agreement", "",
              "Pearson r of the substituted mass against the mean tokens until divergence, across the policies "
              "that always fetch the first choice (Fisher-z 95% CI). Predicted: r < 0 (more mass, earlier "
              "divergence); held when the CI lies below 0.", ""]
    for m in result.mass_agreement:
        if m.correlation is None:
            lines.append(f"- {m.kind}: not computed ({m.note}; {m.n} policies)")
        else:
            c = m.correlation
            word = "held" if c.high < 0 else "did not hold"
            lines.append(f"- {m.kind}: r = {c.r:.3f} [95% CI {c.low:.3f}, {c.high:.3f}] over {c.n} policies: "
                         f"{word}")
    lines.append("")
    if result.warnings:
        lines += ["Notes:", ""] + [f"- {w}" for w in result.warnings] + [""]
    return lines


def render_generation_markdown(result: GenerationResult) -> str:
    o = result.options
    lines = ["# Generation test: greedy generation under each policy against the full model", "",
             f"Model `{shown(o.model)}`. Regenerate with `{' '.join(o.argv) or 'harness generate'}`.", ""]
    return "\n".join(lines + generation_section(result)) + "\n"
