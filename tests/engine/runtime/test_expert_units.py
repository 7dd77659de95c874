"""Experts cut into units (engine/runtime/expert_units.py): each unit holds exactly the expert's
values, and the units' outputs add up to the expert's."""

import pytest
import torch
import torch.nn.functional as F

from moeferry.engine.runtime import expert_units as eu
from moeferry.engine.storage import quant


def expert(bits: int, group: int, hidden: int, inter: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    spec = quant.QuantSpec(bits, group, 128)
    return {"w1": quant.random_qmatrix(inter, hidden, spec, gen), "w3": quant.random_qmatrix(inter, hidden, spec, gen),
            "w2": quant.random_qmatrix(hidden, inter, spec, gen)}


def forward(w: dict, x: torch.Tensor) -> torch.Tensor:
    d = {m: quant.dequantize(w[m]) for m in ("w1", "w3", "w2")}
    return F.linear(F.silu(F.linear(x, d["w1"])) * F.linear(x, d["w3"]), d["w2"])


@pytest.mark.parametrize("bits,group,hidden,inter,units", [
    (2, 16, 256, 512, 2), (2, 32, 256, 512, 4), (3, 16, 128, 1024, 2), (4, 64, 256, 1024, 2), (2, 16, 128, 384, 2)])
def test_units_hold_the_experts_values_and_add_up(bits, group, hidden, inter, units):
    w = expert(bits, group, hidden, inter)
    assert eu.can_split(w["w1"], w["w2"], units) == ""
    parts = eu.split_expert(w, units)
    full = {m: quant.dequantize(w[m]) for m in ("w1", "w3", "w2")}
    seen = []
    for p, part in enumerate(parts):
        n = eu.unit_index(inter, w["w1"].groups, units, p)
        seen.append(n)
        assert torch.equal(quant.dequantize(part["w1"]), full["w1"][n])
        assert torch.equal(quant.dequantize(part["w3"]), full["w3"][n])
        assert torch.equal(quant.dequantize(part["w2"]), full["w2"][:, n])
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(inter))  # a partition
    x = torch.randn(3, hidden)
    torch.testing.assert_close(sum(forward(part, x) for part in parts), forward(w, x), rtol=1e-4, atol=1e-5)


def test_a_cut_that_does_not_divide_the_groups_is_refused():
    w = expert(2, 16, 128, 48 * 16)  # 48 groups
    assert eu.can_split(w["w1"], w["w2"], 2) == ""
    assert "row groups" in eu.can_split(w["w1"], w["w2"], 5)


@pytest.fixture(scope="module")
def store2(tmp_path_factory):
    """A random 8-expert top-2 model with 2-bit experts (8 row groups per expert matrix)."""
    from moeferry.engine.storage.convert import convert_checkpoint
    from tests.conftest import make_checkpoint

    d = tmp_path_factory.mktemp("units")
    make_checkpoint(d / "ck", seed=5, num_local_experts=8, num_hidden_layers=3, hidden_size=64, intermediate_size=128)
    convert_checkpoint(d / "ck", d / "st", 2, 16, "cpu")
    return d / "st"


PROMPT = [1, 10, 20, 30, 40, 50, 60, 7]


@pytest.mark.parametrize("units,cached,depth,cpu", [(2, 8, 0, "off"), (2, 3, 1, "off"), (4, 5, 2, "off"),
                                                    (2, 2, 0, "all"), (2, 3, 1, "auto")])
def test_a_model_of_units_gives_the_experts_logits_and_tokens(store2, units, cached, depth, cpu):
    from moeferry.engine.runtime.generate import SamplingSettings, load_engine
    from moeferry.engine.runtime.placement import Costs

    greedy = SamplingSettings(temperature=0, max_new_tokens=12)
    whole = load_engine(store2, device="cpu", dtype="float32", cache_experts=cached, prefetch=depth)
    cut = load_engine(store2, device="cpu", dtype="float32", cache_experts=cached * units, prefetch=depth,
                      expert_units=units, cpu_experts=cpu)
    assert cut.config.num_experts == 8 * units and cut.config.top_k == 2 * units
    if cpu == "auto":  # stated costs, not the ones measured at load: a busy machine made the CPU look slow
        cut.model.hybrid.costs = Costs(link_gbps=1e-6, cpu_gbps=1.0, gpu_expert_s=0.0)
    ids = torch.tensor(PROMPT)
    for e in (whole, cut):
        e.model.setup_kv(64)
    got, want = cut.model.forward(ids, 0), whole.model.forward(ids, 0)
    if cpu == "off":  # the same dequantized values, summed in another order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:  # the CPU kernel rounds its inputs to int8 per block of 32, and a unit's blocks differ
        assert (got - want).norm() < 1e-2 * want.norm()
    for e in (whole, cut):
        e.eos_ids, e.cached_ids = set(), []
    assert list(cut.generate_ids(PROMPT, greedy)) == list(whole.generate_ids(PROMPT, greedy))
    if cpu != "off":
        assert cut.last_stats.misses_cpu > 0


def test_a_store_whose_experts_cannot_be_cut_gets_one_sentence(store2):
    from moeferry.engine.errors import UserError
    from moeferry.engine.runtime.generate import load_engine

    with pytest.raises(UserError, match="row groups do not divide into 3 units"):
        load_engine(store2, device="cpu", dtype="float32", expert_units=3)
