#!/usr/bin/env python3
"""Writes tests/fixtures/reference_counts.json: the token ids that the reference
implementations produce for every line of tests/fixtures/corpus.txt (and for the whole file as
one text).

References:
  * OpenAI encodings cl100k_base and o200k_base: Python `tiktoken`, `encode_ordinary` (special
    token text such as <|endoftext|> is ordinary text, as for user content).
  * Hugging Face: Python `tokenizers` with the DeepSeek tokenizer.json shipped by PyPI `litellm`
    (see scripts/fetch-fixtures.sh), `encode(text, add_special_tokens=False)` for the ids and
    `add_special_tokens=True` for the count with special tokens.

Offline: tiktoken normally downloads its rank files on first use. scripts/reference.sh points
TIKTOKEN_CACHE_DIR at a folder holding the rank files that tiktoken-rs ships, under the names
tiktoken's load.py looks for (sha1 hex of the blob URL); tiktoken then checks their SHA-256
against the hashes it pins, so the Rust and Python sides provably use the same ranks.

Usage: gen_reference.py --hf PATH/deepseek_tokenizer.json [--out FILE]
Run through scripts/reference.sh, which prepares the environment.
"""

import argparse
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "fixtures", "corpus.txt")
DEFAULT_OUT = os.path.join(HERE, "fixtures", "reference_counts.json")
ENCODINGS = ("cl100k_base", "o200k_base")
HF_NAME = "deepseek"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, help="path to deepseek_tokenizer.json")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    import tiktoken
    import tokenizers

    with open(CORPUS, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    # One case per line (split on "\n" only, nothing trimmed), then the whole file.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    cases = [{"name": f"line {i + 1}", "text": line} for i, line in enumerate(lines)]
    cases.append({"name": "whole file", "text": text})

    encs = {name: tiktoken.get_encoding(name) for name in ENCODINGS}
    with open(args.hf, "rb") as f:
        hf_bytes = f.read()
    hf = tokenizers.Tokenizer.from_str(hf_bytes.decode("utf-8"))

    for case in cases:
        t = case["text"]
        for name, enc in encs.items():
            ids = enc.encode_ordinary(t)
            case[name] = {"count": len(ids), "ids": ids}
        plain = hf.encode(t, add_special_tokens=False).ids
        special = hf.encode(t, add_special_tokens=True).ids
        case[HF_NAME] = {
            "count": len(plain),
            "ids": plain,
            "count_with_special": len(special),
        }

    meta = {
        "generator": "crates/tokenscope-tokenize/tests/gen_reference.py",
        "corpus_sha256": hashlib.sha256(raw).hexdigest(),
        "tiktoken_version": tiktoken.__version__,
        "tokenizers_version": tokenizers.__version__,
        "hf_tokenizer": {
            "name": HF_NAME,
            "file": "deepseek_tokenizer.json",
            "sha256": hashlib.sha256(hf_bytes).hexdigest(),
            "source": "PyPI litellm: litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json (MIT)",
        },
        "encodings": list(ENCODINGS),
    }
    # One case per line keeps the file reviewable and diffs small.
    out = ['{"meta": ' + json.dumps(meta, ensure_ascii=False) + ',', ' "cases": [']
    for i, case in enumerate(cases):
        sep = "," if i + 1 < len(cases) else ""
        out.append("  " + json.dumps(case, ensure_ascii=False, separators=(",", ":")) + sep)
    out.append(" ]}")
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {len(cases)} cases to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
