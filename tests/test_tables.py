"""The C++ tables and the harness's lists are one: the miss rules (src/llama/llama-expert-rules.cpp's
LLAMA_EXPERT_RULES) and harness.domain.catalogue.RULES; the spec keys (LLAMA_EXPERT_SPEC_KEYS in
src/llama/llama-expert-spec.h) and every key the harness writes into a spec; the statistics' "config" block
(LLAMA_EXPERT_CONFIG_FIELDS) and a captured statistics file. Read from the C++ source, as tests/test_stats_schema.py
reads the counter table."""

from __future__ import annotations

import json
import re

from harness.core import project
from harness.domain.catalogue import POLICIES, RULES, policy_cache_spec
from harness.orchestration.composition import band_items

SRC = project.project_root() / "src" / "llama"


def _macro_rows(path_name: str, macro: str) -> list[str]:
    text = (SRC / path_name).read_text()
    m = re.search(rf"#define {macro}\(X\)((?:[^\n]*\\\n)*[^\n]*\n)", text)
    assert m, f"{macro} not found in {path_name}"
    return re.findall(r"X\((\w+),", m.group(1))


def cpp_rules() -> dict[str, tuple[str, ...]]:
    """rule name -> its own spec keys, in the table's order."""
    text = (SRC / "llama-expert-rules.cpp").read_text()
    rows = re.findall(r'\{\s*LLAMA_EXPERT_MISS_\w+,\s*"([^"]+)",\s*"([^"]*)"', text)
    assert rows, "no rows in LLAMA_EXPERT_RULES"
    return {name: tuple(k for k in keys.split(",") if k) for name, keys in rows}


def cpp_keys() -> list[str]:
    return _macro_rows("llama-expert-spec.h", "LLAMA_EXPERT_SPEC_KEYS")


def test_rule_lists_are_equal() -> None:
    assert tuple(cpp_rules()) == RULES


def test_the_rule_enum_has_a_row_per_value_in_order() -> None:
    text = (SRC / "llama-expert-rules.h").read_text()
    enum = re.findall(r"(LLAMA_EXPERT_MISS_\w+)\s*=\s*(\d+),", text)
    rows = re.findall(r"\{\s*(LLAMA_EXPERT_MISS_\w+),", (SRC / "llama-expert-rules.cpp").read_text())
    assert [int(v) for _, v in enum] == list(range(len(enum)))
    assert [n for n, _ in enum] == rows


def test_rule_keys_are_spec_keys() -> None:
    keys = set(cpp_keys())
    assert len(keys) == len(cpp_keys()), "a spec key is listed twice"
    for rule, own in cpp_rules().items():
        assert set(own) <= keys, (rule, set(own) - keys)


def _check_items(items: tuple[tuple[str, str], ...] | list[tuple[str, str]], where: str) -> None:
    keys = set(cpp_keys())
    rules = cpp_rules()
    d = dict(items)
    assert set(d) <= keys, f"{where}: keys the engine does not take: {sorted(set(d) - keys)}"
    if "rule" in d:
        assert d["rule"] in rules, f"{where}: rule={d['rule']} is not in the engine's table"
        for k in d:
            owners = [r for r, own in rules.items() if k in own]
            assert not owners or d["rule"] in owners, f"{where}: {k} belongs to {owners}, not to rule={d['rule']}"


def test_every_key_the_harness_writes_is_a_spec_key() -> None:
    for name in POLICIES:
        _check_items(policy_cache_spec(name, "emulate", 16, "stats.json").items(), f"catalogue.POLICIES[{name!r}]")
    _check_items(band_items(lo=0.3), "composition.band_items(lo=)")
    _check_items(band_items(hi=0.05), "composition.band_items(hi=)")
    # harness study's rank split (study_matched.py): heavy non-first choices and light first choices
    _check_items(band_items(lo=0.15, min_rank=1), "composition.band_items(lo=, min_rank=)")
    _check_items(band_items(hi=0.2, max_rank=0), "composition.band_items(hi=, max_rank=)")


def test_the_checks_above_can_fail() -> None:
    for bad in ((("rule", "bands"),), (("colour", "red"),), (("rule", "threshold"), ("lo", "0.3"))):
        try:
            _check_items(bad, "planted")
        except AssertionError:
            continue
        raise AssertionError(f"{bad} passed")


def test_config_block_keeps_every_captured_field_in_order() -> None:
    fields = _macro_rows("llama-expert-spec.h", "LLAMA_EXPERT_CONFIG_FIELDS")
    assert len(set(fields)) == len(fields)
    path = project.project_root() / "tests" / "data" / "patched-cpu" / "cache-stats-quality.json"
    captured = list(json.loads(path.read_text())["config"])
    assert [f for f in fields if f in captured] == captured, "the config block lost or reordered a field"
    assert {"band_lo", "band_hi", "band_min_rank", "band_max_rank"} <= set(fields)


def test_the_docs_key_table_is_the_parsers() -> None:
    """docs/spec-keys.md, the one table of the spec keys for users, names every key of LLAMA_EXPERT_SPEC_KEYS and
    no other (its first column: one or more backticked keys a row)."""
    text = (project.project_root() / "docs" / "spec-keys.md").read_text()
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    documented = [k for cell in rows for k in re.findall(r"`(\w+)`", cell)]
    assert len(documented) == len(set(documented)), "a key has two rows"
    assert set(documented) == set(cpp_keys()), (set(cpp_keys()) - set(documented), set(documented) - set(cpp_keys()))
