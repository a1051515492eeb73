"""Converts the tests' Gemma 3 270M GGUF into a Hugging Face folder vLLM can serve.

    python scripts/vllm-convert.py MODEL.gguf OUT_DIR

Run by scripts/install-vllm.sh in vLLM's venv (transformers + gguf), offline. vLLM 0.32 no
longer loads GGUF; transformers reads it (dequantised) and writes safetensors. What the GGUF
does not carry in a form vLLM reads is set here:

* the weights in bfloat16 (the dtype the tests serve with);
* `add_bos_token` on: Gemma needs <bos> first, and the GGUF's tokenizer metadata is read
  without it;
* a Gemma chat template (<start_of_turn>user … <end_of_turn>, a system message folded into the
  first user turn, as Gemma's own template does);
* stop ids 1 (<eos>) and 106 (<end_of_turn>) in generation_config.json, so a chat reply ends
  at the end of its turn.

The model is the base model: completions are coherent, chat replies are not; the tests only
measure it.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}"
    "{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}"
    "{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "<start_of_turn>{{ role }}\n"
    "{% if loop.first %}{{ first_user_prefix }}{% endif %}"
    "{{ text | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: vllm-convert.py MODEL.gguf OUT_DIR")
    gguf, out = sys.argv[1], sys.argv[2]
    folder, name = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16
    )
    # The weights are already dequantised tensors; transformers only keeps a GGUF "quantizer"
    # marker, which refuses to save. Drop it so that plain safetensors are written.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    tokenizer.add_bos_token = True
    tokenizer.chat_template = CHAT_TEMPLATE
    model.generation_config.eos_token_id = [1, 106]
    model.generation_config.bos_token_id = 2
    model.generation_config.pad_token_id = 0
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Some tokenizer classes keep add_bos_token only in the Python object: write it into the
    # saved config as well, where vLLM's tokenizer loading reads it.
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["add_bos_token"] = True
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    ids = tokenizer("Hello")["input_ids"]
    if not ids or ids[0] != 2:
        sys.exit(f"vllm-convert: the tokenizer does not start with <bos> (ids {ids[:4]})")
    print(f"converted {gguf} -> {out} (bos-first tokenizer, stop ids 1 and 106)")


if __name__ == "__main__":
    main()
