import pytest

from harness.core.errors import HarnessError
from harness.core.sizes import parse_size
from harness.domain.plan import BANK_PADDING, budget_bytes, budget_terms, plan_slots, slots_for_residency
from harness.parsers.gguf_model import ExpertTensor, ModelInfo

MiB = 2**20


def _info(n_expert: int = 64, k: int = 8, layers: int = 4, per_expert: int = MiB,
          non_expert: int = 100 * MiB) -> ModelInfo:
    tensors = tuple(
        ExpertTensor(f"blk.{il}.ffn_{kind}_exps.weight", kind, "weight", "F16", (8, 8, n_expert),
                     per_expert // 3 * n_expert)
        for il in range(layers) for kind in ("gate", "up", "down"))
    expert_bytes = sum(t.n_bytes for t in tensors)
    return ModelInfo(path="x.gguf", arch="qwen3moe", name="x", n_layers=layers, moe_layers=tuple(range(layers)),
                     n_expert=n_expert, n_expert_used=k, n_expert_shared=0, gating="softmax", weights_norm=True,
                     merged_gate_up=False, expert_tensors=tensors, expert_bytes=expert_bytes,
                     non_expert_bytes=non_expert, file_bytes=expert_bytes + non_expert, file_type="F16")


def test_slots_fill_the_budget() -> None:
    info = _info()
    per = info.bytes_per_expert  # 3 * (MiB // 3)
    overhead = per * 4 + BANK_PADDING * 12  # the spare slot of each of the 12 banks, and their padding
    budget = info.non_expert_bytes + overhead + 20 * per * 4 + per  # room for 20 per layer, plus a bit
    p = plan_slots(info, parse_size(str(budget)))
    assert p.slots_per_layer == 20
    assert plan_slots(info, parse_size(str(budget - 2 * per))).slots_per_layer == 19  # the spare slot counts
    assert p.cache_bytes == 20 * per * 4
    assert p.cache_bytes + p.non_expert_bytes <= budget
    assert not p.fits_whole_model


def test_reserve_is_taken_first() -> None:
    info = _info()
    per = info.bytes_per_expert
    budget = info.non_expert_bytes + 20 * per * 4 + per * 4 + BANK_PADDING * 12
    assert plan_slots(info, parse_size(str(budget)), reserve=4 * per * 4).slots_per_layer == 16


def test_whole_model_fits() -> None:
    info = _info()
    p = plan_slots(info, parse_size("10G"))
    assert p.slots_per_layer == info.n_expert and p.fits_whole_model


def test_percent_budget_means_share_of_experts() -> None:
    info = _info()
    # the share of the experts, plus the cache's spare slot and padding: exactly that share is resident
    assert budget_bytes(info, parse_size("25%")) == budget_terms(info).fixed + info.expert_bytes // 4
    assert plan_slots(info, parse_size("25%")).slots_per_layer == 16
    assert plan_slots(info, parse_size("25%"), reserve=10 * MiB).slots_per_layer == 16


def test_too_small_budget_names_the_minimum() -> None:
    info = _info()
    with pytest.raises(HarnessError, match="too small.*minimum is"):
        plan_slots(info, parse_size("50M"))
    # exactly k slots per layer is enough
    per = info.bytes_per_expert
    minimum = info.non_expert_bytes + 8 * per * 4 + per * 4 + BANK_PADDING * 12
    assert budget_terms(info).minimum == minimum
    assert plan_slots(info, parse_size(str(minimum))).slots_per_layer == 8
    with pytest.raises(HarnessError, match="too small"):
        plan_slots(info, parse_size(str(minimum - 1)))
    with pytest.raises(HarnessError):
        plan_slots(info, parse_size(str(info.non_expert_bytes + 8 * per * 4 - 1)))


@pytest.mark.parametrize(("fraction", "n_expert", "want", "python_round"), [
    (0.25, 10, 3, 2),  # 2.5: a half rounds away from zero (the engine's lround), not to even (Python's round)
    (0.25, 6, 2, 2),  # 1.5
    (0.625, 4, 3, 2),  # 2.5
    (0.15625, 16, 3, 2),  # 2.5 (15.625%)
    (0.1328125, 64, 9, 8),  # 8.5 (13.28125%)
    (0.025, 100, 3, 2),  # 2.5 (2.5%), also a float32 of 2.5 exactly
    (0.45, 10, 5, 4),  # 4.5 (45%: neither 0.45 nor 45 as a float32 is exact; the product still rounds up)
    (0.125, 64, 8, 8),  # exact
    (0.24, 10, 2, 2),  # 2.4
    (0.26, 10, 3, 3),  # 2.6
])
def test_slots_for_residency_rounds_halves_as_the_engine(fraction: float, n_expert: int, want: int,
                                                          python_round: int) -> None:
    assert slots_for_residency(fraction, n_expert) == want
    assert round(fraction * n_expert) == python_round  # where these differ, the old round() was not the engine's


def test_slots_for_residency_bounds() -> None:
    assert slots_for_residency(0.25, 2) == 1  # 0.5 -> 1 (round() gives 0)
    assert slots_for_residency(0.001, 64) == 1  # the engine's floor: one slot
    assert slots_for_residency(0.001, 64, at_least=8) == 8  # the commands' floor: k
    assert slots_for_residency(0.25, 64, at_least=8) == 16
    assert slots_for_residency(1.0, 64) == 64 and slots_for_residency(0.999, 64) == 64
