"""The Hugging Face side of crates/trainer/tests/hf.rs, run with the test environment's Python.

  hf_side.py logits DIR IDS_JSON OUT       GPT2LMHeadModel.from_pretrained(DIR)'s f32 logits for
                                           the (B, T) ids, saved to OUT (safetensors, "logits")
  hf_side.py save-random DIR CONFIG_JSON   a GPT2LMHeadModel of a random GPT2Config(**CONFIG),
                                           save_pretrained(DIR)
  hf_side.py generate DIR PROMPT N         AutoTokenizer and the model from DIR; the prompt's ids
                                           and N greedy tokens (generate, do_sample=False) as
                                           one JSON line on stdout
"""

import json
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel


def load(path):
    model = GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def logits(path, ids_json, out):
    ids = torch.tensor(json.loads(ids_json), dtype=torch.long)  # (B, T)
    with torch.no_grad():
        out_logits = load(path)(ids).logits  # (B, T, V)
    save_file({"logits": out_logits.contiguous()}, out)


def save_random(path, config_json):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**json.loads(config_json)))
    # Larger than the default 0.02 spread, so the logits compared are far from zero.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)


def generate(path, prompt, n):
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = load(path)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]  # (1, T0)
    # No early stop at <|endoftext|>: mtrain sample generates all N tokens.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )  # (1, T0 + n)
    full = out[0].tolist()
    assert len(full) == ids.shape[1] + n, f"generate gave {len(full) - ids.shape[1]} tokens, not {n}"
    text = tokenizer.decode(full, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    print(json.dumps({"prompt_ids": ids[0].tolist(), "ids": full, "text": text}))


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "logits":
        logits(*args)
    elif command == "save-random":
        save_random(*args)
    elif command == "generate":
        generate(args[0], args[1], int(args[2]))
    else:
        sys.exit(f"unknown command {command!r}; see the docstring")


if __name__ == "__main__":
    main()
