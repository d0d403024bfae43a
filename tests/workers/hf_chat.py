"""A tiny random HF Llama directory with a real tokenizer and a chat template, made offline
(transformers for the model, tokenizers for a byte-level BPE), for the fine-tuning tests and
docs/finetuning.md's walk-through."""

from __future__ import annotations

import json
import os
import sys
import sysconfig

import torch

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VOCAB = 384  # divisible by tp = 1, 2, 4

# ChatML, as many instruct models ship it: an optional system turn, then the turns, each
# closed by <|im_end|>; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _training_text() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for name in ("textwrap.py", "string.py", "glob.py", "fnmatch.py"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
            docs.append(f.read())
    docs.append("user assistant system What is the answer? The answer is 42. Hello!\n" * 50)
    return docs


def make_tokenizer(path: str, vocab: int = VOCAB) -> None:
    """tokenizer.json (byte-level BPE with EOS and the ChatML markers as special tokens) and a
    tokenizer_config.json holding the chat template, as transformers saves them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": IM_END,
                "bos_token": None,
                "pad_token": EOS,
                "chat_template": CHAT_TEMPLATE,
            },
            f,
            indent=2,
        )


def make_chat_model(
    path: str, seed: int = 0, tokenizer: bool = True, vocab: int = VOCAB, **token_ids
):
    """A random tiny LlamaForCausalLM (GQA, tied embeddings) with the tokenizer above;
    `token_ids` (bos_token_id, ...) go into its config (eos_token_id 2 unless given)."""
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        **({"eos_token_id": 2} | token_ids),
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size="100KB")
    if tokenizer:
        make_tokenizer(path, vocab=vocab)
    return model


if __name__ == "__main__":  # python tests/workers/hf_chat.py DIR
    make_chat_model(sys.argv[1])
    print(f"wrote a tiny chat Llama to {sys.argv[1]}")


def write_instruction_data(path: str, n: int, seed: int = 0, kind: str = "mixed") -> None:
    """n lines of prompt/completion and chat messages with uneven lengths (and so uneven
    numbers of loss tokens): system turns, multi-turn conversations, short and long answers."""
    import random

    rng = random.Random(seed)
    words = "the a answer is of to list string value function return zero one two many".split()

    def text(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for i in range(n):
            chat = kind == "messages" or (kind == "mixed" and i % 2 == 0)
            if chat:
                messages = []
                if rng.random() < 0.5:
                    messages.append({"role": "system", "content": text(2, 6)})
                for _ in range(rng.randint(1, 2)):
                    messages.append({"role": "user", "content": text(2, 10) + "?"})
                    messages.append({"role": "assistant", "content": text(1, 20) + "."})
                f.write(json.dumps({"messages": messages}) + "\n")
            else:
                record = {"prompt": text(2, 12) + "? ", "completion": text(1, 25) + "."}
                f.write(json.dumps(record) + "\n")
