"""engine/storage/paper_format.py: importing the paper's pre-quantized offloading checkpoint.

The acceptance fixture (tests/fixtures/paperfmt-a.tar.gz; tests/fixtures/README.md says where it
came from) is a tiny checkpoint written by the paper's own code with the paper model's logits and
greedy tokens.
Other checkpoints of that format (other shapes, 3-bit codes, plain float16 metadata, other
file names, a tokenizer in the folder) are written here from the format description, packed
with hqq's own BitPack, and checked against an independent decoder that follows the doc.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeferry.engine.errors import UserError
from moeferry.engine.runtime.generate import SamplingSettings, load_engine
from moeferry.engine.runtime.model import ModelConfig
from moeferry.engine.storage import quant, store
from moeferry.engine.storage.paper_format import (
    TOKENIZER_REPO,
    common_meta_group,
    describe_matrix,
    import_paper_checkpoint,
    kind_quantization,
)

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "paperfmt-a.tar.gz"


# ---------------------------------------------------------------------------------------------
# Helpers: the fixture, a tiny tokenizer, the CLI, an independent decoder of the format


def fixture_dir(tmp: Path) -> tuple[Path, Path]:
    """(checkpoint folder, reference.safetensors) extracted under tmp."""
    if not FIXTURE.is_file():
        pytest.fail(f"The acceptance fixture {FIXTURE} is missing from the checkout; "
                    f"restore it with `git checkout -- tests/fixtures`.")
    with tarfile.open(FIXTURE) as tar:
        try:
            tar.extractall(tmp, filter="data")
        except TypeError:  # Pythons before the extraction filters
            tar.extractall(tmp)
    ck = next(p.parent for p in tmp.rglob("model.safetensors.index.json"))
    ref = next(tmp.rglob("reference.safetensors"))
    return ck, ref


def make_tokenizer(folder: Path, vocab_size: int) -> Path:
    """WordLevel tokenizer: '<unk>' 0, '<s>' 1, '</s>' 2, then 't3' ... ; BOS is prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def prompt_text(ids: list[int]) -> str:
    assert ids[0] == 1  # BOS, added by the tokenizer
    return " ".join(f"t{i}" for i in ids[1:])


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeferry.engine.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def unpack_paper_codes(wq: torch.Tensor, rows: int) -> torch.Tensor:
    """The doc's packing: rows in blocks; 3-bit is hqq's int32 '3bit_32'."""
    if wq.dtype == torch.int32:
        from hqq.core.bitpack import BitPack
        return BitPack.unpack_3bit_32(wq)[:rows].long()
    bits = 8 * wq.shape[0] // rows
    per = 8 // bits
    return torch.cat([(wq.long() >> (8 - bits * (j + 1))) & (2 ** bits - 1) for j in range(per)])


def paper_meta(t: dict, p: str, which: str) -> torch.Tensor:
    """The doc's scale or zero vector, float32, flattened row-major."""
    if p + f"meta.{which}" in t:
        return t[p + f"meta.{which}"].float().reshape(-1)
    q = t[p + f"meta.{which}_q"].float()
    return ((q - t[p + f"meta.meta_{which}.zero"].float()) * t[p + f"meta.meta_{which}.scale"].float()).reshape(-1)


def paper_decode(t: dict, p: str, rows: int, cols: int) -> torch.Tensor:
    """W [rows, cols] float32 exactly as the format describes it (independent of engine/storage/quant.py)."""
    code = unpack_paper_codes(t[p + "W_q"], rows).float()
    scale, zero = paper_meta(t, p, "scale"), paper_meta(t, p, "zero")
    G = scale.numel() // cols
    n = torch.arange(rows)
    return (code - zero.view(G, cols)[n % G]) * scale.view(G, cols)[n % G]


def store_matrices(path: Path) -> dict[str, torch.Tensor]:
    """Every attention and expert matrix of a store, dequantized by the engine (float32)."""
    st = store.open_store(path)
    out = {}
    for name, w in store.read_dense(st).items():
        if isinstance(w, quant.QMatrix):
            out[name] = quant.dequantize(w)
    experts = store.experts_array(st)
    for l in range(st.config.num_layers):
        for e in range(st.config.num_experts):
            mats = store.view_expert(experts[l, e].clone(), st.expert_fields, st.expert_quant, st.config)
            for m, w in mats.items():
                out[f"{l}.{e}.{m}"] = quant.dequantize(w) if isinstance(w, quant.QMatrix) else w.float()
    return out


def checkpoint_matrices(ck: Path) -> dict[str, torch.Tensor]:
    """The same matrices, decoded from the paper checkpoint with paper_decode."""
    cfg = ModelConfig.from_hf(json.loads((ck / "config.json").read_text()))
    wmap = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    trunk = {}
    for f in sorted(set(wmap.values())):
        trunk.update({k: v for k, v in load_file(ck / f).items() if k.startswith("model.")})
    out = {}
    for l in range(cfg.num_layers):
        for m in store.ATTN_MATRICES:
            p = f"model.layers.{l}.self_attn.{m}."
            out[p + "weight"] = paper_decode(trunk, p, *store.attn_shape(cfg, m))
        for e in range(cfg.num_experts):
            t = load_file(ck / wmap[f"model.layers.{l}.block_sparse_moe.experts.{e}.w1.W_q"])
            for m in store.EXPERT_MATRICES:
                out[f"{l}.{e}.{m}"] = paper_decode(t, m + ".", *store.expert_shape(cfg, m))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ---------------------------------------------------------------------------------------------
# The acceptance fixture


@pytest.fixture(scope="module")
def paper(tmp_path_factory):
    """(checkpoint, reference tensors, tokenizer folder, imported store)."""
    tmp = tmp_path_factory.mktemp("paper")
    ck, ref_path = fixture_dir(tmp / "fixture")
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    tok = make_tokenizer(tmp / "tokenizer", vocab)
    dest = import_paper_checkpoint(ck, tmp / "store", tokenizer=tok)
    return ck, load_file(ref_path), tok, dest


@pytest.mark.parametrize("cache_experts", [1, 2, 8])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_fixture_logits_and_greedy_tokens_match_the_paper_model(paper, cache_experts, prefetch):
    _, ref, _, dest = paper
    ids = ref["input_ids"][0].tolist()
    engine = load_engine(dest, device="cpu", dtype="float32", cache_experts=cache_experts, prefetch=prefetch)
    engine.model.setup_kv(len(ids))
    logits = engine.model.forward(torch.tensor(ids), 0, last_only=False)  # [12, vocab]
    want = ref["prompt_logits"]
    assert logits.shape == want.shape
    assert rel_err(logits, want) <= 1e-2
    assert float((logits - want).norm() / want.norm()) <= 1e-2
    tokens = list(engine.generate_ids(ids, SamplingSettings(temperature=0, max_new_tokens=8)))
    assert tokens == ref["greedy_new_tokens"].tolist()


def test_fixture_weights_are_exactly_what_the_format_encodes(paper):
    ck, _, _, dest = paper
    mine, theirs = store_matrices(dest), checkpoint_matrices(ck)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)


def test_fixture_codes_and_metadata_are_copied_byte_for_byte(paper):
    ck, _, _, dest = paper
    st = store.open_store(dest)
    wmap = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    t = load_file(ck / wmap["model.layers.1.block_sparse_moe.experts.5.w1.W_q"])
    mats = store.view_expert(store.experts_array(st)[1, 5].clone(), st.expert_fields, st.expert_quant, st.config)
    for m in store.EXPERT_MATRICES:
        qm = mats[m]
        assert torch.equal(qm.planes[0], t[f"{m}.W_q"])
        assert torch.equal(qm.scale.reshape(-1), t[f"{m}.meta.scale_q"].reshape(-1))
        assert torch.equal(qm.zero.reshape(-1), t[f"{m}.meta.zero_q"].reshape(-1))
        assert torch.equal(qm.scale_meta[0], t[f"{m}.meta.meta_scale.scale"].reshape(-1))
        assert torch.equal(qm.scale_meta[1], t[f"{m}.meta.meta_scale.zero"].reshape(-1))
        assert qm.zero_meta.shape == (2, 1)
        assert float(qm.zero_meta[0, 0]) == float(t[f"{m}.meta.meta_zero.scale"])


def test_fixture_manifest_describes_what_is_stored(paper):
    ck, _, _, dest = paper
    m = json.loads((dest / "manifest.json").read_text())
    eq, aq = m["quantization"]["experts"], m["quantization"]["attention"]
    assert eq == {"bits": 2, "group_size": 16, "meta_group": 128, "zero_meta_group": eq["zero_meta_group"],
                  "meta_bits": 8, "method": "paper-import"}
    assert quant.meta_groups(512 * 256 // 16, eq["zero_meta_group"]) == 1  # one zero meta pair per matrix
    assert (aq["bits"], aq["group_size"], aq["meta_group"], aq["meta_bits"]) == (4, 64, 256, 8)
    assert m["source"]["format"] == "paper-offloading-checkpoint"
    assert store.verify_store(dest) == []
    assert (dest / "tokenizer.json").is_file()
    assert not store.temp_sibling(dest).exists()


def test_fixture_expert_bytes_equal_the_papers(paper):
    ck, _, _, dest = paper
    wmap = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    t = load_file(ck / wmap["model.layers.0.block_sparse_moe.experts.0.w1.W_q"])
    paper_bytes = sum(v.numel() * v.element_size() for v in t.values())
    stride = store.open_store(dest).expert_bytes
    assert paper_bytes <= stride <= paper_bytes + len(t) * store.FIELD_ALIGN  # alignment padding only


def mixtral_expert_entries(rows: int, cols: int) -> dict[str, dict]:
    """Header entries of one full-size 2-bit g16 expert matrix as the doc gives them."""
    n = rows * cols // 16
    return {"W_q": {"dtype": "U8", "shape": [rows // 4, cols]},
            "meta.scale_q": {"dtype": "U8", "shape": [128, n // 128]},
            "meta.meta_scale.scale": {"dtype": "F16", "shape": [1, n // 128]},
            "meta.meta_scale.zero": {"dtype": "F16", "shape": [1, n // 128]},
            "meta.zero_q": {"dtype": "U8", "shape": [1, n]},
            "meta.meta_zero.scale": {"dtype": "F16", "shape": []},
            "meta.meta_zero.zero": {"dtype": "F16", "shape": []}}


def test_full_size_mixtral_expert_is_the_papers_66_4_mb():
    hf = {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
          "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6}
    cfg = ModelConfig.from_hf(hf)
    infos, paper_bytes = [], 0
    for m in store.EXPERT_MATRICES:
        entries = mixtral_expert_entries(*store.expert_shape(cfg, m))
        infos.append(describe_matrix(entries, *store.expert_shape(cfg, m), m))
        paper_bytes += sum(math.prod(e["shape"]) * (2 if e["dtype"] == "F16" else 1) for e in entries.values())
    q = kind_quantization(infos, "expert")
    assert (q["bits"], q["group_size"], q["meta_group"], q["meta_bits"]) == (2, 16, 128, 8)
    _, stride = store.expert_layout(cfg, q)
    assert paper_bytes == 66_404_364  # 3 x (W_q + scale_q + zero_q + meta)
    assert paper_bytes <= stride <= paper_bytes + 15 * store.FIELD_ALIGN
    assert abs(stride - 66.4e6) < 200e3


# ---------------------------------------------------------------------------------------------
# The command line contract, errors


def test_cli_convert_then_generate_greedy(paper, tmp_path):
    ck, ref, tok, _ = paper
    dest = tmp_path / "store"
    r = cli("convert", str(ck), str(dest), "--tokenizer", str(tok))
    assert r.returncode == 0, r.stderr
    r = cli("generate", str(dest), "--prompt", prompt_text(ref["input_ids"][0].tolist()), "--temperature", "0",
            "--max-new-tokens", "8", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == ref["greedy_new_tokens"].tolist()
    assert out["text"].split() == [f"t{i}" for i in out["token_ids"]]
    assert {"tokens_per_s", "cache_hits", "bytes_h2d"} <= out["stats"].keys()


def test_matching_bits_are_accepted_and_different_bits_refused(paper, tmp_path):
    ck, _, tok, _ = paper
    import_paper_checkpoint(ck, tmp_path / "ok", expert_bits=2, attn_bits=4, tokenizer=tok)
    for kwargs, flag in (({"expert_bits": 3}, "--expert-bits 3"), ({"attn_bits": 8}, "--attn-bits 8")):
        with pytest.raises(UserError) as e:
            import_paper_checkpoint(ck, tmp_path / "bad", tokenizer=tok, **kwargs)
        assert e.value.exit_code == 2
        assert flag in str(e.value) and "2-bit experts, 4-bit attention" in str(e.value)
        assert not (tmp_path / "bad").exists() and not store.temp_sibling(tmp_path / "bad").exists()
    r = cli("convert", str(ck), str(tmp_path / "bad"), "--expert-bits", "4", "--tokenizer", str(tok))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeferry: ") and "--expert-bits 4" in lines[0]


def test_missing_tokenizer_is_a_clear_error(paper, tmp_path, monkeypatch):
    ck, _, _, _ = paper
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for tokenizer in (None, TOKENIZER_REPO, str(tmp_path / "nowhere")):
        with pytest.raises(UserError) as e:
            import_paper_checkpoint(ck, tmp_path / "store", tokenizer=tokenizer)
        msg = str(e.value)
        assert e.value.exit_code == 2
        assert "--tokenizer" in msg and TOKENIZER_REPO in msg and "licence" in msg
        assert not (tmp_path / "store").exists() and not store.temp_sibling(tmp_path / "store").exists()
    r = cli("convert", str(ck), str(tmp_path / "store"), env={"HF_HUB_CACHE": str(tmp_path / "empty-cache")})
    assert r.returncode == 2 and "--tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_tokenizer_from_a_repo_id_in_the_hf_cache(paper, tmp_path, monkeypatch):
    ck, _, tok, _ = paper
    cache = tmp_path / "hub"
    repo = cache / ("models--" + TOKENIZER_REPO.replace("/", "--"))
    snap = repo / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    for f in tok.iterdir():  # tokenizer files only, as AutoTokenizer leaves them: no weights
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    dest = import_paper_checkpoint(ck, tmp_path / "store", tokenizer=TOKENIZER_REPO)
    assert (dest / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()


def test_cancel_leaves_nothing_and_progress_reaches_one(paper, tmp_path):
    ck, _, tok, _ = paper
    cancel, seen = threading.Event(), []

    def progress(fraction, message):
        seen.append(fraction)
        if len(seen) == 3:
            cancel.set()

    with pytest.raises(UserError) as e:
        import_paper_checkpoint(ck, tmp_path / "store", tokenizer=tok, progress=progress, cancel=cancel)
    assert e.value.exit_code == 1 and "cancelled" in str(e.value)
    assert not (tmp_path / "store").exists() and not store.temp_sibling(tmp_path / "store").exists()
    seen.clear()
    import_paper_checkpoint(ck, tmp_path / "store", tokenizer=tok, progress=lambda f, m: seen.append(f))
    assert seen == sorted(seen) and seen[-1] == 1.0
    with pytest.raises(UserError, match="not empty"):
        import_paper_checkpoint(ck, tmp_path / "store", tokenizer=tok)


# ---------------------------------------------------------------------------------------------
# Other checkpoints of the format, written from the doc


def quantize_like_hqq(w: torch.Tensor, bits: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max HQQ axis-0 quantization: (codes [rows, cols], scale [G*cols], zero [G*cols])."""
    rows, cols = w.shape
    G = rows // g
    v = w.view(g, G, cols)  # row n = i*G + j is in group j
    lo, hi = v.amin(0), v.amax(0)
    scale = ((hi - lo) / (2 ** bits - 1)).clamp(min=1e-6)
    zero = -lo / scale
    codes = torch.round(v / scale + zero).clamp(0, 2 ** bits - 1).to(torch.uint8).view(rows, cols)
    return codes, scale.reshape(-1), zero.reshape(-1)


def meta8(values: torch.Tensor, s: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values [N] -> (uint8 [s, N/s], meta scale, meta zero) ([1, N/s]); s None: one scalar pair."""
    v = values.view(1, -1) if s is None else values.view(s, -1)
    lo, hi = v.amin(0, keepdim=True), v.amax(0, keepdim=True)
    if s is None:
        lo, hi = lo.min(), hi.max()
    sc = ((hi - lo) / 255).clamp(min=1e-8).half()
    z = (-lo / sc.float()).half()
    q = torch.round(v / sc.float() + z.float()).clamp(0, 255).to(torch.uint8)
    return q, sc, z


def paper_matrix(w: torch.Tensor, bits: int, g: int, s: int | None, plain_meta: bool) -> dict[str, torch.Tensor]:
    """One matrix in the paper's format (W_q packed by hqq's BitPack, as the paper's code does)."""
    from hqq.core.bitpack import BitPack

    codes, scale, zero = quantize_like_hqq(w, bits, g)
    pack = {2: BitPack.pack_2bit_u8, 3: BitPack.pack_3bit_32, 4: BitPack.pack_4bit_u8}[bits]
    out = {"W_q": pack(codes if bits != 3 else codes.to(torch.int32)).contiguous()}
    if plain_meta:
        out["meta.scale"], out["meta.zero"] = scale.half().view(1, -1), zero.half().view(1, -1)
        return out
    q, a, b = meta8(scale, s)
    out.update({"meta.scale_q": q, "meta.meta_scale.scale": a, "meta.meta_scale.zero": b})
    q, a, b = meta8(zero, None)
    out.update({"meta.zero_q": q.view(1, -1), "meta.meta_zero.scale": a.reshape(()),
                "meta.meta_zero.zero": b.reshape(())})
    return out


def write_paper_checkpoint(folder: Path, hf: dict, spec, seed: int = 0) -> None:
    """spec(kind, layer, expert, name) -> (bits, group, s or None, plain_meta). Files named unlike the paper's."""
    torch.manual_seed(seed)
    cfg = ModelConfig.from_hf(hf)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(hf))
    H, V = cfg.hidden_size, cfg.vocab_size
    trunk = {"model.embed_tokens.weight": torch.randn(V, H), "lm_head.weight": torch.randn(V, H) * 0.05,
             "model.norm.weight": 1 + 0.1 * torch.randn(H)}
    wmap = {}
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        trunk[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(H)
        trunk[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H)
        trunk[p + "block_sparse_moe.gate.weight"] = torch.randn(cfg.num_experts, H) * 0.2
        for m in store.ATTN_MATRICES:
            w = torch.randn(*store.attn_shape(cfg, m)) * 0.05
            for k, v in paper_matrix(w, *spec("attention", l, None, m)).items():
                trunk[f"{p}self_attn.{m}.{k}"] = v
        for e in range(cfg.num_experts):
            expert = {}
            for m in store.EXPERT_MATRICES:
                w = torch.randn(*store.expert_shape(cfg, m)) * 0.05
                expert.update({f"{m}.{k}": v for k, v in paper_matrix(w, *spec("expert", l, e, m)).items()})
            name = f"moe/blk{l}-x{e}.safetensors"
            (folder / "moe").mkdir(exist_ok=True)
            save_file(expert, folder / name)
            wmap[f"{p}block_sparse_moe.experts.{e}.w1.W_q"] = name
    trunk = {k: (v.half() if v.is_floating_point() and v.dtype == torch.float32 else v) for k, v in trunk.items()}
    save_file(trunk, folder / "base.safetensors")
    wmap.update({k: "base.safetensors" for k in trunk})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def reference_model(ck: Path):
    """A transformers Mixtral with the weights decoded by paper_decode (float32)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    hf = json.loads((ck / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf)
    wmap = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    trunk = load_file(ck / wmap["model.embed_tokens.weight"])
    mats = checkpoint_matrices(ck)
    sd = {k: v.float() for k, v in trunk.items() if k.endswith(("norm.weight", "embed_tokens.weight", "lm_head.weight"))}
    for l in range(cfg.num_layers):
        p = f"model.layers.{l}."
        sd[p + "mlp.gate.weight"] = trunk[p + "block_sparse_moe.gate.weight"].float()
        for m in store.ATTN_MATRICES:
            sd[f"{p}self_attn.{m}.weight"] = mats[f"{p}self_attn.{m}.weight"]
        e = range(cfg.num_experts)
        sd[p + "mlp.experts.gate_up_proj"] = torch.stack([torch.cat([mats[f"{l}.{i}.w1"], mats[f"{l}.{i}.w3"]]) for i in e])
        sd[p + "mlp.experts.down_proj"] = torch.stack([mats[f"{l}.{i}.w2"] for i in e])
    config = MixtralConfig(**{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model.load_state_dict(sd, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.float().eval()


TINY = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 320,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}


def three_bit_plain_attention(kind, layer, expert, name):
    if kind == "expert":
        return 3, 32, 64, False
    return 4, 32, None, True  # attention: plain float16 scale and zero


def mixed_meta(kind, layer, expert, name):
    if kind == "expert":  # every other expert keeps plain float16 metadata
        return 2, 16, 128, bool((expert + layer) % 2)
    return 4, 32, (256 if name in ("q_proj", "o_proj") else 128), False  # s differs per matrix


@pytest.mark.parametrize("spec", [three_bit_plain_attention, mixed_meta])
def test_other_checkpoints_of_the_format(tmp_path, spec):
    ck = tmp_path / "ck"
    write_paper_checkpoint(ck, TINY, spec)
    make_tokenizer(ck, TINY["vocab_size"])  # this one brings its tokenizer
    dest = import_paper_checkpoint(ck, tmp_path / "store")
    m = json.loads((dest / "manifest.json").read_text())["quantization"]
    mine, theirs = store_matrices(dest), checkpoint_matrices(ck)
    if spec is three_bit_plain_attention:
        assert (m["experts"]["bits"], m["experts"]["meta_bits"], m["attention"]["meta_bits"]) == (3, 8, 16)
    else:  # experts: 8-bit metadata decoded to float16 (the paper's own arithmetic) beside plain float16
        assert m["experts"]["meta_bits"] == 16 and m["attention"]["meta_bits"] == 8
        assert m["attention"]["meta_group"] == 128  # s = 256 and 128: 256's pairs repeated twice
    for name in theirs:
        decoded = spec is mixed_meta and not name.startswith("model.")
        tol = {"rtol": 2e-3, "atol": 2e-3} if decoded else {"rtol": 1e-6, "atol": 1e-7}
        torch.testing.assert_close(mine[name], theirs[name], **tol, msg=name)

    ids = [1, 17, 45, 99, 3, 250, 7, 64]
    with torch.inference_mode():
        want = reference_model(ck)(torch.tensor([ids])).logits[0]
    engine = load_engine(dest, device="cpu", dtype="float32", cache_experts=2, prefetch=1)
    engine.model.setup_kv(len(ids))
    got = engine.model.forward(torch.tensor(ids), 0, last_only=False)
    assert rel_err(got, want) <= (1e-4 if spec is three_bit_plain_attention else 1e-2)


def test_other_checkpoint_through_the_cli(tmp_path):
    ck = tmp_path / "ck"
    write_paper_checkpoint(ck, TINY, three_bit_plain_attention, seed=3)
    make_tokenizer(ck, TINY["vocab_size"])
    ids = [1, 5, 9, 200, 31, 77]
    model, out = reference_model(ck), list(ids)
    with torch.inference_mode():
        for _ in range(6):
            tok = int(model(torch.tensor([out])).logits[0, -1].argmax())
            out.append(tok)
            if tok == 2:
                break
    r = cli("convert", str(ck), str(tmp_path / "store"))
    assert r.returncode == 0, r.stderr
    r = cli("generate", str(tmp_path / "store"), "--prompt", prompt_text(ids), "--temperature", "0",
            "--max-new-tokens", "6", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == out[len(ids):]


def test_mixed_bit_widths_are_refused(tmp_path):
    def spec(kind, layer, expert, name):
        return (3 if expert == 1 else 2, 16, 128, False) if kind == "expert" else (4, 32, 128, False)

    ck = tmp_path / "ck"
    write_paper_checkpoint(ck, TINY, spec)
    make_tokenizer(ck, TINY["vocab_size"])
    with pytest.raises(UserError, match="expert matrices mix bit widths"):
        import_paper_checkpoint(ck, tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_common_meta_group():
    assert common_meta_group([(8192, 64), (8192, 64)]) == 128  # the paper's experts: s = 128
    assert common_meta_group([(1024, 1), (512, 1)]) == 1024  # scalar zeros: one pair per matrix
    g = common_meta_group([(1024, 4), (512, 4)])  # different s: pairs repeated, never wrong
    assert all(quant.meta_groups(n, g) % m == 0 for n, m in [(1024, 4), (512, 4)])
