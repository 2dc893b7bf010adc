"""harness.orchestration.study_domains: tokens placed in the text's domains by character, and the paired
comparisons per domain (hand-computed)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.core.errors import HarnessError
from harness.domain.verdicts import DomainRow
from harness.orchestration.study_domains import domain_ranges, domain_rows, token_domains
from harness.parsers.nll_dump import NllDump
from harness.stats.intervals import DeltaPPL


def _d(delta: float, low: float, high: float) -> DeltaPPL:
    return DeltaPPL(delta, low, high, 10.0, 10.0, 1000, 20, 2000, 0)


def test_domain_ranges_join_documents_with_one_newline() -> None:
    docs = [{"domain": "code", "chars": 10}, {"domain": "code", "chars": 5}, {"domain": "prose", "chars": 7}]
    # code: [0, 10) + "\n" + [11, 16); prose starts after the next newline: [17, 24)
    assert domain_ranges(docs) == [("code", 0, 16), ("prose", 17, 24)]
    with pytest.raises(HarnessError, match="the sources file is damaged"):
        domain_ranges([{"domain": "code"}])


def test_token_domains_by_character_start_and_bos_offset() -> None:
    ranges = [("code", 0, 16), ("prose", 17, 24)]
    starts = [0, 4, 9, 15, 16, 17, 20]  # the newline at 16 goes with the domain before it
    pos = np.array([1, 2, 3, 4, 5, 6, 7], dtype=np.int64)  # llama.cpp's positions, shifted by a BOS
    assert token_domains(pos, 1, starts, ranges).tolist() == ["code", "code", "code", "code", "code", "prose", "prose"]
    assert token_domains(pos[:6] - 1, 0, starts, ranges).tolist()[-1] == "prose"


def test_domain_rows_split_the_paired_delta() -> None:
    n = 40
    chunk = np.repeat(np.arange(4), 10)
    labels = np.asarray(["code"] * 20 + ["prose"] * 20)
    base = np.full(n, 2.0)
    test = base + np.where(labels == "code", 0.1, 0.0)  # only code loses
    dump = NllDump(11, 0, 4, np.arange(n, dtype=np.int32), base)
    other = NllDump(11, 0, 4, np.arange(n, dtype=np.int32), test)
    assert (dump.chunk == chunk).all()
    (row,) = domain_rows(labels, [("t vs b", dump, other)])
    assert row.whole.delta_pct == pytest.approx(100 * np.expm1(0.05))
    code, prose = dict(row.by_domain)["code"], dict(row.by_domain)["prose"]
    assert code is not None and code.delta_pct == pytest.approx(100 * np.expm1(0.1))
    assert prose is not None and prose.delta_pct == pytest.approx(0.0)
    # a dump of another shape is skipped
    short = NllDump(11, 0, 2, np.arange(20, dtype=np.int32), base[:20])
    assert domain_rows(labels, [("x", short, short)]) == ()


def test_a_domain_differs_when_its_ci_lies_across_zero_from_the_whole() -> None:
    row = DomainRow("a vs b", _d(1.0, 0.5, 1.5), (("code", _d(2.0, 1.5, 2.5)), ("prose", _d(-0.5, -0.8, -0.2))))
    assert row.differs == ("prose",)
    assert DomainRow("a vs b", _d(0.1, -0.5, 0.7), (("prose", _d(-0.5, -0.8, -0.2)),)).differs == ()
    assert DomainRow("a vs b", _d(-1.0, -1.5, -0.5), (("code", _d(0.5, 0.2, 0.8)), ("x", None))).differs == ("code",)


def test_a_verdict_names_the_domains_that_differ() -> None:
    from harness.domain.finding import Verdict
    from harness.orchestration.study import with_domains

    rows = (DomainRow("speed vs rule-0.15 (5: C)", _d(1.0, 0.5, 1.5), (("code", _d(2.0, 1.5, 2.5)),
                                                                       ("prose", _d(-0.5, -0.8, -0.2)))),
            DomainRow("heavy non-first vs light first choices (R)", _d(1.0, 0.5, 1.5), (("code", _d(1, 0.5, 1.5)),)))
    v = with_domains(Verdict("5. quality-first ...", False, "e"), rows)
    assert v.evidence == "e; differs by domain (speed vs rule-0.15 (5: C): prose)"
    assert with_domains(Verdict("1 and 3. weight, not rank", True, "e"), rows).evidence == "e"
    assert with_domains(Verdict("2. mass hypothesis", True, "e"), rows).evidence == "e"
