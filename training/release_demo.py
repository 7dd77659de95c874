"""Turn a trained demo checkpoint into the shipped store and the numbers in docs/DEMO.md.

    python training/release_demo.py CKPT [--work /tmp/demo_stores] [--threads 2]

1. converts CKPT into resources/demo (experts 4-bit, attention 8-bit; replaces the old one);
2. held-out perplexity at 16-, 4-, 3- and 2-bit experts (attention 16-bit), and of the shipped
   store: each bit-width is converted with the engine's quantizer into WORK, loaded back with
   moeferry.engine.storage.store.load_dequantized_hf_model (the weights the engine computes with) and scored on
   the held-out plain text (training/data/tokens.npz `heldout_text`) in 512-token windows,
   each with a fresh context: ppl = exp(mean NLL);
3. sample answers of the shipped store from the engine itself (greedy, CPU);
4. the locality study on the shipped store (held-out text): tables and docs/locality.png;
5. writes all of it between the result markers of docs/DEMO.md, and results.json into WORK.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moeferry.engine.measure import locality  # noqa: E402
from moeferry.engine.setup.demo import demo_store_path  # noqa: E402
from moeferry.engine.storage.convert import convert_checkpoint  # noqa: E402
from moeferry.engine.storage.store import load_dequantized_hf_model  # noqa: E402

SHIPPED_BITS = (4, 8)  # experts, attention
PROMPTS = [
    "What is a list in Python?",
    "How do I open a file?",
    "What does `len` do?",
    "Explain the `json` module.",
    "Hello",
]
START, END = "<!-- results:start -->", "<!-- results:end -->"


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int = 512) -> tuple[float, int]:
    n = (len(stream) - 1) // seq_len
    nll, count = 0.0, 0
    for i in range(0, n, 8):
        k = min(8, n - i)
        idx = torch.arange(i, i + k)[:, None] * seq_len + torch.arange(seq_len + 1)
        x = stream[idx]
        logits = model(input_ids=x[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count), count


def store_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def ensure_store(ckpt: Path, dest: Path, expert_bits: int, attn_bits: int) -> Path:
    """dest converted from ckpt, reusing a store made from this very checkpoint (as its manifest
    records) after the checkpoint was last written."""
    manifest = dest / "manifest.json"
    reusable = (manifest.is_file()
                and json.loads(manifest.read_text())["source"]["path"] == str(ckpt.resolve())
                and manifest.stat().st_mtime > max(p.stat().st_mtime for p in ckpt.glob("*.safetensors")))
    if not reusable:
        if dest.exists():
            shutil.rmtree(dest)
        t0 = time.time()
        convert_checkpoint(ckpt, dest, expert_bits, attn_bits, "cpu")
        print(f"converted {dest} in {time.time() - t0:.0f} s", flush=True)
    return dest


def sample_answers(store: Path, max_new_tokens: int = 60) -> list[dict]:
    from moeferry.engine.runtime.generate import SamplingSettings, load_engine
    engine = load_engine(store, device="cpu")
    out = []
    for p in PROMPTS:
        t0 = time.perf_counter()
        s = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
        text = "".join(piece.text for piece in engine.stream(p, s, chat=True))
        st = engine.last_stats
        out.append({"prompt": p, "reply": text, "tokens": st.new_tokens,
                    "tokens_per_s": round(st.tokens_per_s, 1),
                    "first_token_s": round(st.first_token_s, 3),
                    "seconds": round(time.perf_counter() - t0, 2)})
        print(f"Q: {p}\nA: {text}\n", flush=True)
    engine.close()
    return out


def training_summary(ckpt: Path) -> dict:
    log_path = ckpt / "train_log.json"
    if not log_path.is_file():
        return {}
    log = json.loads(log_path.read_text())
    a = log.get("args", {})
    return {"device": a.get("device"), "seed": a.get("seed"), "steps": log.get("steps_done"),
            "steps_arg": a.get("steps"), "minutes_arg": a.get("minutes"),
            "batch_tokens": (a.get("batch_size") or 0) * (a.get("seq_len") or 0),
            "seconds": log.get("seconds"), "params": log.get("params"), "best": log.get("best"),
            "init": a.get("init"),
            "best_s": next((e.get("s") for e in log.get("eval", [])
                            if e.get("step") == (log.get("best") or {}).get("step")), None)}


def render(results: dict, report: locality.LocalityReport) -> str:
    t = results["training"]
    lines = []
    if t:
        best = t.get("best") or {}
        tokens = (t.get("steps") or 0) * t.get("batch_tokens", 0)
        lines += [f"Checkpoint: {t['params'] / 1e6:.1f}M parameters, trained on `{t['device']}` "
                  f"for {t['steps']} steps of {t['batch_tokens']} tokens ({tokens / 1e6:.1f}M tokens, "
                  f"{tokens / 4.0e6:.1f} epochs) in {t['seconds'] / 60:.1f} min, seed {t['seed']}; "
                  f"best held-out loss {best.get('heldout_loss', float('nan')):.3f} at step "
                  f"{best.get('step')}."
                  + (f" The shipped weights are that step's ({best['step'] * t['batch_tokens'] / 1e6:.1f}M "
                     f"tokens, {best['step'] * t['batch_tokens'] / 4.0e6:.1f} epochs, reached "
                     f"{t['best_s'] / 60:.1f} min into the run); later evaluations were worse."
                     if best.get("step") and t.get("steps") and best["step"] < t["steps"]
                     and t.get("best_s") is not None else "")
                  + (f" It continued from the weights of `{Path(t['init']).name}`." if t.get("init") else ""),
                  ""]
    lines += ["### Held-out perplexity by expert bit-width (the analogue of the paper's Table 1)", "",
              f"{results['perplexity'][0]['tokens']} held-out tokens (5% of the sections of the "
              "Python docs, never trained on), 512-token windows.", "",
              "| experts | attention | held-out ppl | store size |", "|---|---|---|---|"]
    for r in results["perplexity"]:
        mark = " (shipped)" if (r["expert_bits"], r["attn_bits"]) == SHIPPED_BITS else ""
        lines.append(f"| {r['expert_bits']}-bit | {r['attn_bits']}-bit{mark} | "
                     f"{r['perplexity']:.2f} | {r['store_bytes'] / 1e6:.1f} MB |")
    lines += ["", "### Sample answers (shipped store, `moeferry generate demo --chat`, greedy, "
              "this 2-core CPU)", ""]
    for s in results["samples"]:
        reply = s["reply"].strip().replace("\n", "\n> ") or "(nothing but white space)"
        lines += [f"**{s['prompt']}** ({s['tokens']} tokens, {s['tokens_per_s']} tokens/s, "
                  f"first token {s['first_token_s']} s)", "", f"> {reply}", ""]
    lines += ["### Expert locality (the analogue of the paper's Figure 2)", "",
              locality.markdown_tables(report),
              "![LRU hit ratio and prefetch recall](locality.png)", ""]
    return "\n".join(lines)


def write_docs(block: str, doc: Path) -> None:
    text = doc.read_text() if doc.is_file() else f"# The demo model\n\n{START}\n{END}\n"
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    doc.write_text(f"{head}{START}\n{block}\n{END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/demo_stores"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bits", type=int, nargs="+", default=[16, 4, 3, 2])
    ap.add_argument("--keep-store", action="store_true", help="do not replace resources/demo")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    shipped = demo_store_path()
    if not args.keep_store:
        if shipped.exists():
            shutil.rmtree(shipped)
        ensure_store(args.ckpt, shipped, *SHIPPED_BITS)
        # the corpus licence asks for its notice in derivative works; verify ignores extra files
        shutil.copy(ROOT / "training" / "data" / "PSF-LICENSE.txt", shipped / "PSF-LICENSE.txt")
    print(f"shipped store: {store_bytes(shipped) / 1e6:.2f} MB", flush=True)

    with np.load(ROOT / "training" / "data" / "tokens.npz") as z:
        stream = torch.from_numpy(z["heldout_text"].astype(np.int64))
    rows = []
    configs = [(b, 16) for b in args.bits] + [SHIPPED_BITS]
    for eb, ab in configs:
        dest = shipped if (eb, ab) == SHIPPED_BITS else ensure_store(
            args.ckpt, args.work / f"e{eb}-a{ab}", eb, ab)
        ppl, n = perplexity(load_dequantized_hf_model(dest), stream)
        rows.append({"expert_bits": eb, "attn_bits": ab, "perplexity": round(ppl, 3),
                     "tokens": n, "store_bytes": store_bytes(dest)})
        print(json.dumps(rows[-1]), flush=True)

    samples = sample_answers(shipped)
    report = locality.measure_locality(str(shipped))
    locality.plot_report(report, ROOT / "docs" / "locality.png",
                         title=f"Expert locality of the demo model, {report.tokens} held-out tokens")
    print(locality.markdown_tables(report))
    results = {"training": training_summary(args.ckpt), "perplexity": rows, "samples": samples,
               "locality": json.loads(report.to_json())}
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    write_docs(render(results, report), ROOT / "docs" / "DEMO.md")
    print("wrote docs/DEMO.md and docs/locality.png")


if __name__ == "__main__":
    main()
