"""Sample text from a checkpoint: see what a run has learned.

python tools/generate.py CHECKPOINT --prompt "def " [--max-new-tokens 64]
                         [--temperature 0 | --temperature 0.8 --top-k 50 --seed 1]
python tools/generate.py CHECKPOINT --chat "What is 6 x 7?" [--system "Answer briefly."]

CHECKPOINT is a DCP training checkpoint (a step directory, or a run / checkpoints directory for
its latest checkpoint) or a directory written by tools/export_checkpoint.py (or any Hugging Face
directory of a supported family with safetensors). The tokenizer is the tokenizer.json saved
with the checkpoint unless --tokenizer is given. Temperature 0 is greedy decoding. One process,
no GPU needed.
The prompt and the new tokens together may be at most the model's max_position_embeddings (from
the checkpoint's config), checked before the weights are read. The prompt runs once, then each
new token runs alone against the cached keys and values of the ones before it
(hybrid2d/decode.py), so a token costs one token's forward, not the whole sequence's.

--chat renders the question as a user turn (after an optional --system turn) with the chat
template stored with the tokenizer (chat_template.jinja or tokenizer_config.json), opens the
assistant's turn, and prints the answer, stopping at the end-of-turn token (tokenizer_config's
eos_token) or the end-of-text token.
"""

from __future__ import annotations

import json
import math
import os
import sys

from hybrid2d.cli import OneLineParser
from hybrid2d.errors import ConfigError


def parse(argv):
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="DCP step/run directory or exported safetensors directory")
    p.add_argument("--prompt", default="", help="text to continue ('' starts a new document)")
    p.add_argument("--chat", default=None, help="a question, rendered with the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system turn before it")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="at least 1; the prompt plus these at most the model's max_position_embeddings "
        "(KV cache: each new token runs one token's forward)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="", help="tokenizer.json (default: the checkpoint's)")
    p.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    p.add_argument("--json", action="store_true", help="print {prompt, completion, ids} as JSON")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature {args.temperature} must be a finite number >= 0 (0: greedy)")
    if args.top_k < 0:
        p.error(f"--top-k {args.top_k} must be >= 0 (0: no limit)")
    if args.chat is not None and args.prompt:
        p.error("--chat and --prompt exclude each other: --chat is the question, --prompt raw text")
    if args.system is not None and args.chat is None:
        p.error("--system needs --chat")
    return args


def sample(
    model,
    ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_id: int | set[int] | None = None,
    max_context: int | None = None,
) -> list[int]:
    """New token ids after `ids`: greedy at temperature 0, else softmax(logits / T) over the
    top_k likeliest. The context is the last max_context tokens (all if None). A `Llama` runs the
    prompt once and then each new token alone against its KV cache (hybrid2d/decode.py); once
    the context outgrows max_context, each token reruns the sliding window, as any other model
    (a callable tokens[b, s] -> logits[b, s, V]) does for every token."""
    import torch

    from hybrid2d.decode import Decoder
    from hybrid2d.models.llama import Llama

    gen = torch.Generator().manual_seed(seed)
    stops = {stop_id} if isinstance(stop_id, int) else set(stop_id or ())
    out: list[int] = []
    context = list(ids)
    decoder = None
    if isinstance(model, Llama):
        longest = len(ids) + max_new_tokens - 1  # the last new token is never fed back
        decoder = Decoder(model, min(longest, max_context) if max_context else longest)
    with torch.no_grad():
        for i in range(max_new_tokens):
            window = context[-max_context:] if max_context else context
            if decoder is None:
                logits = model(torch.tensor([window]))[0, -1].float()
            elif i == 0 or len(window) < len(context):  # the prompt, or a window that slid
                logits = decoder.prefill(torch.tensor([window]))[0, -1].float()
            else:  # the cache holds context[:-1]
                logits = decoder.step(torch.tensor([context[-1:]]))[0, -1].float()
            if temperature == 0:
                nxt = int(torch.argmax(logits))
            else:
                logits = logits / temperature
                if top_k and top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            out.append(nxt)
            context.append(nxt)
            if nxt in stops:
                break
    return out


def check_length(prompt_tokens: int, new_tokens: int, max_positions: int) -> None:
    """ConfigError unless the prompt and the new tokens fit in the positions the model was built
    for (its config's max_position_embeddings)."""
    if prompt_tokens + new_tokens <= max_positions:
        return
    built = f"the model was built for {max_positions} positions (max_position_embeddings)"
    if prompt_tokens >= max_positions:
        raise ConfigError(f"the prompt is {prompt_tokens} tokens and {built}: shorten it")
    raise ConfigError(
        f"--max-new-tokens {new_tokens}: {prompt_tokens} prompt tokens + {new_tokens} is "
        f"{prompt_tokens + new_tokens}, and {built}; give at most {max_positions - prompt_tokens}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from tokenizers import Tokenizer

    from hybrid2d.checkpoint import standalone
    from hybrid2d.data.chat import end_of_turn_ids, load_chat_template
    from hybrid2d.data.tokenizer import EOS_CANDIDATES

    try:
        src = standalone.locate(args.checkpoint)
        tok_path = args.tokenizer or standalone.tokenizer_path(src)
        if not tok_path:
            raise ConfigError(
                f"{src.path} has no tokenizer.json; pass --tokenizer PATH (the run's tokenizer "
                "is cached under its data.cache_dir/tokenizers)"
            )
        try:
            tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the tokenizers library raises plain Exception
            raise ConfigError(f"tokenizer {tok_path} cannot be read ({e})") from None
        template, chat_text = None, None
        if args.chat is not None:
            template = load_chat_template(str(tok_path))
            if template is None:
                raise ConfigError(
                    f"--chat: {os.path.dirname(tok_path) or '.'} has no chat template "
                    "(chat_template.jinja or tokenizer_config.json chat_template); use a "
                    "checkpoint of a model with one, or --prompt"
                )
            messages = [] if args.system is None else [{"role": "system", "content": args.system}]
            messages.append({"role": "user", "content": args.chat})
            try:
                chat_text = template.render(messages, add_generation_prompt=True)
            except ValueError as e:
                raise ConfigError(f"--chat: the chat template fails to render ({e})") from None
        eos = next((i for n in EOS_CANDIDATES if (i := tok.token_to_id(n)) is not None), None)
        if chat_text is not None:
            ids = tok.encode(chat_text, add_special_tokens=False).ids
        else:
            ids = tok.encode(args.prompt).ids if args.prompt else []
        if not ids:
            if eos is None:
                raise ConfigError("empty prompt and the tokenizer has no end-of-text token")
            ids = [eos]  # packed training data separates documents with EOS: start a new one
        # The config alone (no weights read, no checksums computed) bounds the length.
        check_length(
            len(ids), args.max_new_tokens, standalone.model_config(src).max_position_embeddings
        )
        if src.kind == "dcp":
            standalone.verify(src.path)
        model, cfg = standalone.load_model(src)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stops = ({eos} if eos is not None else set()) | end_of_turn_ids(str(tok_path), tok)
    new = sample(
        model,
        ids,
        args.max_new_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        None if args.no_stop else stops,
        cfg.max_position_embeddings,
    )
    completion = tok.decode(new, skip_special_tokens=True)
    if args.json:
        shown = chat_text if chat_text is not None else args.prompt
        print(json.dumps({"prompt": shown, "completion": completion, "ids": new}))
    elif chat_text is not None:
        print(completion.strip())
    else:
        print(args.prompt + completion)
    return 0


if __name__ == "__main__":
    sys.exit(main())
