"""Hostile checkpoints of every family: a wrong shape, a missing tensor, a wrong dtype or an
absurd count in config.json is refused by `moeferry convert` in one sentence, before any tensor
is read and before anything is written (tests/engine/storage/test_hostile_store.py does the same for Mixtral)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.storage.test_hostile_store import cli, one_sentence
from tests.engine.test_families import BY_ID, build, mxfp4_checkpoint, save

MXFP4 = "gpt_oss-mxfp4"
BELONG = "does not belong to these weights"


def checkpoint(tmp_path, vid):
    ck = tmp_path / "ck"
    if vid == MXFP4:
        mxfp4_checkpoint(ck)
    else:
        save(BY_ID[vid], build(BY_ID[vid]), ck)
    return ck


def edit_tensor(ck, name, change) -> None:
    """Rewrite the shard that holds `name` with change(tensor) in its place (None: dropped).
    model.safetensors.index.json is left as it was, as a damaged download would leave it."""
    for f in sorted(ck.glob("*.safetensors")):
        sd = load_file(f)
        if name in sd:
            new = change(sd.pop(name))
            if new is not None:
                sd[name] = new.contiguous()
            save_file(sd, f, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} is in no shard")


def edit_config(ck, **changes) -> None:
    hf = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(hf | changes))


def convert(ck, tmp_path):
    r = cli("convert", str(ck), str(tmp_path / "st"), "--expert-bits", "16", "--attn-bits", "16", "--device", "cpu")
    assert not (tmp_path / "st").exists()
    return r


drop = lambda t: None  # noqa: E731
one_more_row = lambda t: torch.cat([t, t[:1]])  # noqa: E731
swap_last = lambda t: t.transpose(-1, -2)  # noqa: E731
L0 = "model.layers.0."

CASES = [  # variant, tensor, change, words the sentence holds
    # qwen3_moe, per expert (layer 1 is a dense MLP layer) and stacked (layers 1 and 3 hold experts)
    ("qwen3_moe-top3-dense-layer", L0 + "mlp.experts.2.down_proj.weight", swap_last, "has shape"),
    ("qwen3_moe-top3-dense-layer", "model.layers.2.mlp.experts.4.up_proj.weight", drop, "lacks 1 tensors"),
    ("qwen3_moe-top3-dense-layer", L0 + "self_attn.q_norm.weight", one_more_row, "q_norm.weight has shape"),
    ("qwen3_moe-top3-dense-layer", "model.layers.1.mlp.gate_proj.weight", swap_last, "mlp.gate_proj.weight has"),
    ("qwen3_moe-top1-sparse-step-stacked", "model.layers.3.mlp.experts.gate_up_proj", lambda t: t[:-1], "has shape"),
    ("qwen3_moe-top1-sparse-step-stacked", "model.layers.1.mlp.experts.down_proj", drop, "down_proj"),
    ("qwen3_moe-top1-sparse-step-stacked", "model.layers.1.mlp.experts.down_proj", lambda t: t.to(torch.int32),
     "is I32"),
    # olmoe: q/k norms over the whole projection
    ("olmoe-top3", L0 + "mlp.experts.5.gate_proj.weight", lambda t: t[:, :-1], "has shape"),
    ("olmoe-top3", L0 + "self_attn.k_norm.weight", lambda t: t[:-2], "k_norm.weight has shape"),
    ("olmoe-top1-clip-stacked", "model.layers.2.mlp.experts.gate_up_proj", swap_last, "has shape"),
    ("olmoe-top1-clip-stacked", L0 + "mlp.gate.weight", one_more_row, "mlp.gate.weight has shape"),
    # qwen2_moe: the shared expert and its gate, q/k/v biases
    ("qwen2_moe-shared-top3", "model.layers.1.mlp.shared_expert.up_proj.weight", drop, "shared_expert.up_proj"),
    ("qwen2_moe-shared-top3", L0 + "mlp.shared_expert_gate.weight", one_more_row, "shared_expert_gate.weight has"),
    ("qwen2_moe-shared-top3", L0 + "self_attn.v_proj.bias", one_more_row, "v_proj.bias has shape"),
    # gpt_oss, bf16 experts as x @ W: a [E, 2F, H] gate_up_proj is the wrong layout
    ("gpt_oss-top1-window3", L0 + "mlp.experts.gate_up_proj", swap_last, "has shape"),  # 2F = 80, H = 48
    ("gpt_oss-top3-window5", L0 + "mlp.experts.down_proj_bias", drop, "down_proj_bias"),
    ("gpt_oss-top3-window5", L0 + "mlp.experts.gate_up_proj_bias", lambda t: t[:, ::2], "gate_up_proj_bias has"),
    ("gpt_oss-top3-window5", L0 + "self_attn.sinks", one_more_row, "sinks has shape"),
    ("gpt_oss-top3-window5", L0 + "mlp.router.bias", drop, "mlp.router.bias"),
    # gpt_oss, MXFP4 blocks and scales
    (MXFP4, L0 + "mlp.experts.gate_up_proj_scales", lambda t: t[:, :-1], "gate_up_proj_scales has shape"),
    (MXFP4, "model.layers.1.mlp.experts.down_proj_blocks", drop, "down_proj_blocks"),
    (MXFP4, L0 + "mlp.experts.down_proj_blocks", lambda t: t.view(torch.int8), "is I8, not U8"),
]


@pytest.mark.parametrize("vid,name,change,words", CASES, ids=[f"{c[0]}:{c[1].split('.', 3)[-1]}" for c in CASES])
def test_a_damaged_tensor_is_refused_in_one_sentence(tmp_path, vid, name, change, words):
    ck = checkpoint(tmp_path, vid)
    edit_tensor(ck, name, change)
    sentence = one_sentence(convert(ck, tmp_path), 2, words, name)
    assert BELONG in sentence or "lacks" in sentence or "damaged" in sentence, sentence


@pytest.mark.parametrize("vid", ["qwen3_moe-top3-dense-layer", "qwen3_moe-top1-sparse-step-stacked", "olmoe-top3",
                                 "qwen2_moe-shared-top3", "gpt_oss-top3-window5", MXFP4])
@pytest.mark.parametrize("layers,times,words", [(1024, 4096, "at least"),  # more than the files' bytes
                                                (None, 8, "")])  # within the bytes: counts and shapes refuse it
def test_an_inflated_expert_count_is_refused_in_one_sentence(tmp_path, vid, layers, times, words):
    ck = checkpoint(tmp_path, vid)
    hf = json.loads((ck / "config.json").read_text())
    key = next(k for k in ("num_local_experts", "num_experts") if k in hf)  # as transformers saved it
    changes = {key: min(4096, hf[key] * times)}
    if layers:
        changes["num_hidden_layers"] = layers
        if "layer_types" in hf:
            changes["layer_types"] = ["full_attention"] * layers
    edit_config(ck, **changes)
    one_sentence(convert(ck, tmp_path), 2, BELONG, words)
