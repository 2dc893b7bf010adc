import pytest

from harness.core.errors import HarnessError
from harness.core.sizes import parse_size
from harness.domain.plan import BANK_PADDING, budget_bytes, budget_terms, plan_slots
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
