"""Build the tiny bundled model: a byte-level BPE tokenizer and a small Llama trained briefly.

The course, its tests and the quick start all use this model so that nothing has to be
downloaded. It is trained on text every Python installation carries: the docstrings of the
standard library and the language reference topics shipped in `pydoc_data`. It is far too small
to be clever, but it writes English-looking words, which is more fun to watch than random tokens.

    python scripts/make_tiny_model.py --out nanoserve/assets/tiny-llama --minutes 20

The result is committed; you never need to run this to take the course.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# The same shape of prompt as Llama 3's chat format, written for this tokenizer. Tool calling
# (issue 17) in the Llama 3.x manner: with `tools`, a system block lists the functions as JSON and
# asks for a call as one JSON object {"name": ..., "parameters": {...}} (several joined by "; ");
# an assistant message's `tool_calls` are written back in that form, and a `tool` message (the
# function's result) comes under the `ipython` role, as Llama names it. Without tools and tool
# messages the text is exactly what the template wrote before (tests/week10/test_tools.py checks).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{ 'You may call the functions below. To call one, reply with a JSON object and nothing else: "
    "{\"name\": <the function name>, \"parameters\": <an object of its arguments>}. To call several, "
    "join their objects with \"; \". A function result comes back in an ipython message.\n\n' }}"
    "{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\n' }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{{ message['content'] | tojson }}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% elif message['tool_calls'] %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '; ' }}{% endif %}"
    "{{ '{\"name\": ' + function['name'] | tojson + ', \"parameters\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}' }}"
    "{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{% else %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip"}


def collect_corpus() -> list[str]:
    docs: list[str] = []
    try:
        from pydoc_data.topics import topics

        docs += [t.strip() for t in topics.values() if t.strip()]
    except ImportError:
        pass
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        objs = [mod]
        for attr, val in vars(mod).items():
            if attr.startswith("_") or getattr(val, "__module__", None) != name:
                continue
            if inspect.isclass(val):
                objs.append(val)
                objs += [m for k, m in vars(val).items() if not k.startswith("_") and callable(m)]
            elif inspect.isfunction(val) or inspect.isbuiltin(val):
                objs.append(val)
        for obj in objs:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                docs.append(doc)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text can be encoded
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="nanoserve/assets/tiny-llama")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(0)
    torch.manual_seed(0)
    out = Path(args.out)

    docs = collect_corpus()
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f} M characters")
    train_tokenizer(docs, args.vocab, out)

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out)
    eos, eot = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    stream: list[int] = []
    for d in docs:
        stream += tok.encode(d) + [eos]
    data = torch.tensor(stream)
    print(f"corpus: {len(stream) / 1e6:.2f} M tokens")

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=192, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=[eos, eot],
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    seq, batch = 256, 16
    deadline = time.time() + args.minutes * 60
    total_steps_guess = int(args.minutes * 60 / 1.5)  # about 1.5 s a step on one core
    step = 0
    while time.time() < deadline:
        lr = 3e-3 * min(1.0, (step + 1) / 50) * max(0.1, 0.5 * (1 + math.cos(math.pi * min(step, total_steps_guess) / total_steps_guess)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(data) - seq - 1, (batch,))
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e}", flush=True)
        step += 1
    model = model.to(torch.bfloat16)  # halves the file; loaders upcast to the dtype they want
    model.save_pretrained(out)
    prompt = tok("The list", return_tensors="pt").input_ids
    sample = model.float().generate(prompt, max_new_tokens=30, do_sample=False)
    print("sample:", tok.decode(sample[0]))


if __name__ == "__main__":
    main()
