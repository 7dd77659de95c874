"""Train the demo model's byte-level BPE tokenizer and tokenize the corpus.

Input: the folder written by build_corpus.py (train.jsonl, heldout.jsonl).
Output (committed, so that training needs neither the Debian package nor this step):
    training/data/tokenizer/   transformers tokenizer files with the chat template;
                               AutoTokenizer.from_pretrained(folder) works offline
    training/data/tokens.npz   uint16 token streams: train, heldout (all held-out samples),
                               heldout_text (held-out plain text only: the perplexity set)
    training/data/heldout.txt  the held-out plain text (the locality study's default input)

Every sample becomes `<s> ... </s>`; chat samples go through the chat template.

Usage: python training/build_tokenizer.py CORPUS_DIR [--out training/data] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
# One turn = "<|role|>\n" + content + "</s>\n"; the prompt for a reply ends in "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + (message['content'] | trim) + eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def sample_texts(rows: list[dict]):
    for r in rows:
        if r["kind"] == "text":
            yield r["text"]
        else:
            for m in r["messages"]:
                yield m["content"]


def train_tokenizer(rows: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(sample_texts(rows), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=SPECIAL[3:], model_max_length=1024,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def encode_rows(tok: PreTrainedTokenizerFast, rows: list[dict]) -> np.ndarray:
    """One token stream: every sample as <s> ... </s>, in the given order."""
    texts = []
    for r in rows:
        if r["kind"] == "text":
            texts.append(tok.bos_token + r["text"] + tok.eos_token)
        else:  # the template adds <s> and ends every turn with </s>\n
            texts.append(tok.apply_chat_template(r["messages"], tokenize=False))
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    return np.fromiter((t for seq in ids for t in seq), dtype=np.uint16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path, help="folder with train.jsonl and heldout.jsonl")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train = read_jsonl(args.corpus / "train.jsonl")
    held = read_jsonl(args.corpus / "heldout.jsonl")
    tok = train_tokenizer(train, args.vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(args.out / "tokenizer")

    order = np.random.default_rng(args.seed).permutation(len(train))
    held_text = [r for r in held if r["kind"] == "text"]
    streams = {
        "train": encode_rows(tok, [train[i] for i in order]),
        "heldout": encode_rows(tok, held),
        "heldout_text": encode_rows(tok, held_text),
    }
    np.savez_compressed(args.out / "tokens.npz", **streams)
    (args.out / "heldout.txt").write_text("\n\n".join(r["text"] for r in held_text) + "\n",
                                          encoding="utf-8")
    chars = sum(len(t) for t in sample_texts(train))
    for name, s in streams.items():
        print(f"{name}: {len(s)} tokens")
    print(f"train: {chars / len(streams['train']):.2f} characters per token")


if __name__ == "__main__":
    main()
