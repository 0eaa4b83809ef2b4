"""Makes vectors.json: the token ids Hugging Face transformers gives for each case of
cases.json, with the tokenizer directories kv-indexer's tests train (no download).

    KV_INDEXER_TOKENIZER_DIRS=/tmp/tok cargo test --test tokenize -- --ignored write_tokenizer_dirs
    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install transformers tokenizers jinja2
    /tmp/tfenv/bin/python tests/data/tokenize/make_vectors.py /tmp/tok > tests/data/tokenize/vectors.json

A prompt is tokenized as vLLM's /v1/completions does (`tokenizer(prompt)`, with special
tokens); messages as its /v1/chat/completions does: each message built anew as vLLM's
`chat_utils.parse_chat_messages` builds it for a text-only chat (`vllm_conversation` below,
written from reading vLLM, not run from it), then `apply_chat_template(conversation,
add_generation_prompt=True, tokenize=False)`, then `tokenizer(text, add_special_tokens=False)`.
"""
import json
import sys
from pathlib import Path

import jinja2
import jinja2.nodes as nodes
import tokenizers
import transformers


def reads(node, name, key=None):
    """Whether `node` is `name` (or `name[key]` / `name.key`), sliced, filtered or tested."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return reads(node.node, name, key)
    is_name = lambda n: isinstance(n, nodes.Name) and n.ctx == "load" and n.name == name
    if key is None:
        return is_name(node)
    if isinstance(node, nodes.Getitem):
        return is_name(node.node) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return is_name(node.node) and node.attr == key
    return False


def content_format(source):
    """vLLM's "openai" when a loop runs over a message's content, else "string"."""
    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists, queue = ["messages"], ["messages"]
    while queue:
        name = queue.pop(0)
        for assign in ast.find_all(nodes.Assign):
            if reads(assign.node, name) and isinstance(assign.target, nodes.Name):
                if assign.target.name not in lists:
                    lists.append(assign.target.name)
                    queue.append(assign.target.name)
    loops = list(ast.find_all(nodes.For))
    messages = [
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and any(reads(loop.iter, l) for l in lists)
    ]
    for loop in loops:
        if any(reads(loop.iter, m, "content") for m in messages):
            return "openai"
    return "string"


def vllm_conversation(messages, fmt):
    """The messages vLLM gives the template for a chat of text parts only."""
    out = []
    for message in messages:
        content = message.get("content")
        if content is None:
            texts = []
        elif isinstance(content, str):
            texts = [content]
        else:
            texts = [part["text"] for part in content]
        built = {"role": message["role"]}
        if fmt == "openai":
            built["content"] = [{"type": "text", "text": text} for text in texts]
        else:
            built["content"] = "\n".join(texts)
        if isinstance(message.get("name"), str):
            built["name"] = message["name"]
        out.append(built)
    return out


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
        fmt = content_format(tok.chat_template)
        text = tok.apply_chat_template(
            vllm_conversation(case["messages"], fmt),
            add_generation_prompt=True,
            tokenize=False,
        )
        row["content_format"] = fmt
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
