"""Makes vectors.json: the token ids Hugging Face transformers gives for each case of
cases.json, with the tokenizer directories kv-indexer's tests train (no download).

    KV_INDEXER_TOKENIZER_DIRS=/tmp/tok cargo test --test tokenize -- --ignored write_tokenizer_dirs
    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install transformers tokenizers jinja2
    /tmp/tfenv/bin/python tests/data/tokenize/make_vectors.py /tmp/tok > tests/data/tokenize/vectors.json

A prompt is tokenized as vLLM's /v1/completions does (`tokenizer(prompt)`, with special
tokens); messages as its /v1/chat/completions does (`apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)`, then `tokenizer(text, add_special_tokens=False)`).
"""
import json
import sys
from pathlib import Path

import jinja2
import tokenizers
import transformers

root = Path(sys.argv[1])
cases = json.loads((Path(__file__).parent / "cases.json").read_text())
loaded = {}
out = []
for case in cases:
    model = case["model"]
    if model not in loaded:
        loaded[model] = transformers.AutoTokenizer.from_pretrained(str(root / model))
    tok = loaded[model]
    row = dict(case)
    if "prompt" in case:
        row["ids"] = tok(case["prompt"])["input_ids"]
    else:
        text = tok.apply_chat_template(
            case["messages"], add_generation_prompt=True, tokenize=False
        )
        row["text"] = text
        row["ids"] = tok(text, add_special_tokens=False)["input_ids"]
    out.append(row)

trained = json.loads((root / "chatml" / "tokenizer.json").read_text())
print(
    json.dumps(
        {
            "made_with": {
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "jinja2": jinja2.__version__,
            },
            "trained_model": trained["model"],
            "cases": out,
        },
        ensure_ascii=False,
        indent=1,
    )
)
