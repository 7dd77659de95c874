"""How long converting Mixtral-8x7B takes, measured on L layers.

    python -m benchmarks.convert_bench [--layers 4] [--device cuda] [--workdir DIR] [--json]

A random-weight checkpoint of Mixtral-8x7B's shapes, cut to `layers` layers, is written in
Hugging Face's layout (bf16 safetensors shards with an index, per-expert keys, config.json,
a small tokenizer), one shard at a time so host memory stays bounded by one shard. Then
`moeferry.engine.storage.convert.convert_checkpoint` runs on it in a fresh process, so that the peak RSS it
reports (ru_maxrss) is the conversion's and not the generator's. The shards are flushed and
dropped from the page cache first (Linux), so the conversion reads them from disk as it
would read a downloaded checkpoint.

Conversion time splits into a fixed part (start-up, embeddings, final norm, lm_head) and a
part per layer (attention, router, eight experts, and the hashing/verification of their
bytes), so for the full model:

    t(32) = t_fixed + 32 * (t_total - t_fixed) / layers
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moeferry.engine.errors import UserError

CHECKPOINT_MARKER = ".moeferry-bench-checkpoint.json"
SHARD_BYTES = 3 << 30
WEIGHT_STD = 0.015  # Mixtral's weights have a standard deviation of 0.01-0.02
FULL_LAYERS = 32
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


# ---------------------------------------------------------------------------------------------
# The synthetic checkpoint


def hf_config(layers: int, hidden: int, ffn: int, experts: int, vocab: int) -> dict:
    """A Hugging Face Mixtral config.json; 128-wide heads as Mixtral's, narrower for tiny models."""
    head_dim = 128 if hidden >= 1024 else 16
    heads = hidden // head_dim
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 4, min(heads, 2)), "head_dim": head_dim,
            "num_local_experts": experts, "num_experts_per_tok": 2, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
            "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in the order transformers writes them."""
    h, f, e = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                   (p + "block_sparse_moe.gate.weight", (e, h))]
        for x in range(e):
            ep = f"{p}block_sparse_moe.experts.{x}."
            shapes += [(ep + "w1.weight", (f, h)), (ep + "w2.weight", (h, f)), (ep + "w3.weight", (f, h))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]
    return shapes


def plan_shards(shapes, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most shard_bytes (bf16) each."""
    shards, current, size = [], [], 0
    for name, shape in shapes:
        n = 2 * _numel(shape)
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += n
    return shards + [current] if current else shards


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_tokenizer(vocab_size: int, folder: Path) -> None:
    """A character-level tokenizer with exactly vocab_size ids (0-2 are <unk>, <s>, </s>),
    loadable by transformers' AutoTokenizer, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    code = 0x21
    while len(vocab) < vocab_size:
        if not 0x7F <= code <= 0xA0:  # skip DEL and the C1 control characters
            vocab[chr(code)] = len(vocab)
        code += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 32768, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def write_checkpoint(folder: Path, cfg: dict, shard_bytes: int = SHARD_BYTES, device: str = "cpu",
                     seed: int = 0, log=lambda msg: None) -> None:
    """Random bf16 weights in safetensors shards + index, config.json and a tokenizer.

    Tensors are drawn on `device` (a GPU draws 12 GB in seconds) and one shard at a time is
    held in host memory. The marker file is written last: without it the folder is incomplete.
    """
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = plan_shards(tensor_shapes(cfg), shard_bytes)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in shard:
            if len(shape) == 1:  # norms
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
                t = t.mul_(WEIGHT_STD).cpu()
            tensors[key] = t
            weight_map[key] = name
            total += t.numel() * 2
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        del tensors
        log(f"  wrote {name} ({i + 1}/{len(shards)})")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(cfg["vocab_size"], folder)
    (folder / CHECKPOINT_MARKER).write_text(json.dumps({"config": cfg, "seed": seed}))


def checkpoint_ready(folder: Path, cfg: dict, seed: int) -> bool:
    try:
        marker = json.loads((folder / CHECKPOINT_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker == {"config": cfg, "seed": seed}


def drop_from_page_cache(folder: Path) -> bool:
    """Evict the folder's files from the OS page cache (Linux); False where that is not possible."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be evicted
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# The measured conversion (runs in a child process)


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size so far."""
    try:
        import resource
    except ImportError:  # Windows
        try:
            import psutil
            return int(psutil.Process().memory_info().peak_wset)
        except (ImportError, AttributeError):
            return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def measure_conversion(src: str, dest: str, expert_bits: int, attn_bits: int, device: str) -> dict:
    """Convert src -> dest once; wall time split by phase, peak RSS growth and peak VRAM.

    The baseline RSS is taken after torch, hqq and the CUDA context are loaded, so the growth
    is what the conversion itself holds.
    """
    import torch
    from hqq.core.quantize import Quantizer  # noqa: F401 - slow import kept out of the timing

    from moeferry.engine.runtime.generate import resolve_device
    from moeferry.engine.storage.convert import convert_checkpoint

    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.zeros(1, device=dev)
        torch.cuda.reset_peak_memory_stats(dev)
    baseline = peak_rss_bytes()
    ticks = []
    start = time.perf_counter()

    def progress(fraction, message):
        ticks.append((time.perf_counter() - start, message))
        if message.endswith(" expert 0") or fraction >= 1.0:
            print(f"  {fraction * 100:5.1f}%  {message}", file=sys.stderr, flush=True)

    convert_checkpoint(src, dest, expert_bits, attn_bits, str(dev), progress=progress)
    total = time.perf_counter() - start
    peak = peak_rss_bytes()
    phases = {"fixed_s": 0.0, "attention_s": 0.0, "experts_s": 0.0}
    before = 0.0
    for t, message in ticks:
        if message.startswith("converting layer "):
            phases["experts_s"] += t - before
        elif message.startswith("converting model.layers."):
            phases["attention_s"] += t - before
        elif message.startswith("converting "):  # start-up, embeddings, final norm, lm_head
            phases["fixed_s"] += t - before
        before = t
    return {"convert_s": total, **phases,
            "finish_s": total - phases["fixed_s"] - phases["attention_s"] - phases["experts_s"],
            "rss_baseline_bytes": baseline, "rss_peak_bytes": peak,
            "peak_rss_growth_bytes": peak - baseline if peak is not None and baseline is not None else None,
            "peak_vram_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__}


def convert_in_child(src: Path, dest: Path, expert_bits: int, attn_bits: int, device: str) -> dict:
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    args = json.dumps({"src": str(src), "dest": str(dest), "expert_bits": expert_bits,
                       "attn_bits": attn_bits, "device": device})
    proc = subprocess.run([sys.executable, "-m", "benchmarks.convert_bench", "--child", args],
                          stdout=subprocess.PIPE, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise UserError(f"The conversion failed (exit code {proc.returncode}); its message is above.",
                        exit_code=1)
    return json.loads(lines[-1])


def _child_main(args_json: str) -> int:
    try:
        print(json.dumps(measure_conversion(**json.loads(args_json))))
    except UserError as e:
        print(f"moeferry: {e}", file=sys.stderr)
        return e.exit_code
    return 0


# ---------------------------------------------------------------------------------------------
# The benchmark


def bench_convert(layers: int, workdir: Path, expert_bits: int = 2, attn_bits: int = 4,
                  device: str = "cuda", hidden: int = 4096, ffn: int = 14336, experts: int = 8,
                  vocab: int = 32000, *, shard_bytes: int = SHARD_BYTES, keep_store: bool = False,
                  seed: int = 0, log=lambda msg: None) -> dict:
    """Time one conversion of a random `layers`-layer Mixtral checkpoint; extrapolate to 32 layers.

    The checkpoint is kept in workdir and reused by the next run with the same shapes (other
    bit widths, say); the store is removed after it is verified unless keep_store.
    """
    if layers < 1:
        raise UserError("--layers must be 1 or more.")
    import torch

    from moeferry.engine.runtime.generate import resolve_device
    from moeferry.engine.storage.store import verify_store

    dev = resolve_device(device)  # fail before writing gigabytes
    workdir = Path(workdir).expanduser()
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(layers, hidden, ffn, experts, vocab)
    src = workdir / f"mixtral-random-{layers}L-{hidden}x{ffn}x{experts}"
    dest = workdir / f"store-{layers}L-e{expert_bits}-a{attn_bits}"
    params = sum(_numel(s) for _, s in tensor_shapes(cfg))
    reused = checkpoint_ready(src, cfg, seed)
    shutil.rmtree(dest, ignore_errors=True)
    # A store takes at most 0.6 bytes per weight below 16 bits (4-bit: 0.53), 2 at 16.
    need = params * (2 if 16 in (expert_bits, attn_bits) else 0.6) + (0 if reused else 2 * params)
    free = shutil.disk_usage(workdir).free + (folder_bytes(src) if src.exists() and not reused else 0)
    if need > free:
        raise UserError(f"{workdir} has {free / 1e9:.1f} GB free but the benchmark needs about "
                        f"{need / 1e9:.1f} GB; choose another --workdir or fewer --layers.", exit_code=1)
    generate_s = 0.0
    if not reused:
        shutil.rmtree(src, ignore_errors=True)
        log(f"writing a random {layers}-layer Mixtral checkpoint ({2 * params / 1e9:.1f} GB bf16) to {src}")
        t = time.perf_counter()
        gen_device = "cuda" if dev.type == "cuda" else "cpu"
        write_checkpoint(src, cfg, shard_bytes, gen_device, seed, log)
        generate_s = time.perf_counter() - t
        if gen_device == "cuda":
            torch.cuda.empty_cache()
    else:
        log(f"reusing the checkpoint in {src}")
    dropped = drop_from_page_cache(src)
    log(f"converting to {expert_bits}-bit experts, {attn_bits}-bit attention on {dev.type}")
    m = convert_in_child(src, dest, expert_bits, attn_bits, str(dev))
    store_bytes = folder_bytes(dest)
    verified = not verify_store(dest)
    if not keep_store:
        shutil.rmtree(dest, ignore_errors=True)

    matrices = layers * experts * 3
    per_layer = (m["convert_s"] - m["fixed_s"]) / layers
    return {
        "date": time.strftime("%Y-%m-%d"), "device": m["device_name"], "torch": m["torch"],
        "cpu_cores": os.cpu_count(), "layers": layers, "hidden": hidden, "ffn": ffn, "experts": experts,
        "vocab": vocab, "expert_bits": expert_bits, "attn_bits": attn_bits,
        "checkpoint": str(src), "checkpoint_bytes": folder_bytes(src),
        "checkpoint_shards": len(list(src.glob("model-*.safetensors"))),
        "checkpoint_reused": reused, "generate_s": generate_s, "source_read_from_disk": dropped,
        "convert_s": m["convert_s"], "fixed_s": m["fixed_s"], "attention_s": m["attention_s"],
        "experts_s": m["experts_s"], "finish_s": m["finish_s"],
        "expert_matrices": matrices, "s_per_expert_matrix": m["experts_s"] / matrices,
        "per_layer_s": per_layer,
        "peak_rss_growth_bytes": m["peak_rss_growth_bytes"], "rss_baseline_bytes": m["rss_baseline_bytes"],
        "rss_peak_bytes": m["rss_peak_bytes"], "peak_vram_bytes": m["peak_vram_bytes"],
        "store": str(dest) if keep_store else None, "store_bytes": store_bytes, "store_verified": verified,
        "extrapolated_32_layers_s": m["fixed_s"] + FULL_LAYERS * per_layer,
        "extrapolation": (f"t(32) = t_fixed + 32 * (t_total - t_fixed) / {layers} = {m['fixed_s']:.1f} s "
                          f"+ 32 * {per_layer:.1f} s = {m['fixed_s'] + FULL_LAYERS * per_layer:.0f} s"),
    }


def summary(r: dict) -> str:
    from moeferry.engine.units import fmt_bytes

    gb = lambda n: "n/a" if n is None else fmt_bytes(n)  # noqa: E731
    t32 = r["extrapolated_32_layers_s"]
    made = "reused" if r["checkpoint_reused"] else f"written in {r['generate_s']:.0f} s"
    read = "from disk" if r["source_read_from_disk"] else "possibly from the page cache"
    return "\n".join([
        f"Conversion of a random {r['layers']}-layer Mixtral ({r['hidden']}x{r['ffn']}, "
        f"{r['experts']} experts) to {r['expert_bits']}-bit experts / {r['attn_bits']}-bit attention on {r['device']}, "
        f"torch {r['torch']}, {r['date']}:",
        f"  checkpoint     {gb(r['checkpoint_bytes'])} in {r['checkpoint_shards']} shards "
        f"({made}; read {read})",
        f"  total          {r['convert_s']:.1f} s = fixed {r['fixed_s']:.1f} "
        f"+ attention {r['attention_s']:.1f} + experts {r['experts_s']:.1f} "
        f"+ manifest/verify/install {r['finish_s']:.1f}",
        f"  per expert     {r['s_per_expert_matrix']:.3f} s per matrix ({r['expert_matrices']} matrices)",
        f"  peak memory    host RSS +{gb(r['peak_rss_growth_bytes'])} over {gb(r['rss_baseline_bytes'])}, "
        f"VRAM {gb(r['peak_vram_bytes'])}",
        f"  store          {gb(r['store_bytes'])}, "
        f"{'verified' if r['store_verified'] else 'FAILED verification'}",
        f"  32 layers      {r['extrapolation']} ({t32 / 60:.1f} min)"])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.convert_bench",
                                description="Time converting a random Mixtral-8x7B-shaped checkpoint.")
    p.add_argument("--layers", type=int, default=4, help="layers to convert (the time is extrapolated to 32)")
    p.add_argument("--expert-bits", type=int, default=2, choices=(2, 3, 4, 16), help="bits per expert weight")
    p.add_argument("--attn-bits", type=int, default=4, choices=(4, 8, 16), help="bits per attention weight")
    p.add_argument("--device", default="cuda", choices=("auto", "cpu", "cuda"), help="where to quantize")
    p.add_argument("--workdir", help="where the checkpoint (kept for reuse) and store go; "
                                     "default: a temporary folder, removed afterwards")
    p.add_argument("--keep-store", action="store_true", help="keep the converted store in --workdir")
    p.add_argument("--hidden", type=int, default=4096, help="smaller shapes, for a quick try")
    p.add_argument("--ffn", type=int, default=14336, help="expert hidden size (Mixtral: 14336)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (Mixtral: 8)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (Mixtral: 32000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    temp = None if a.workdir else tempfile.mkdtemp(prefix="moeferry-convert-bench-")
    try:
        r = bench_convert(a.layers, Path(a.workdir or temp), a.expert_bits, a.attn_bits, a.device,
                          a.hidden, a.ffn, a.experts, a.vocab, keep_store=a.keep_store and not temp, log=log)
    except UserError as e:
        print(f"convert_bench: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if temp:
            shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps(r, indent=1) if a.json else summary(r))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))
