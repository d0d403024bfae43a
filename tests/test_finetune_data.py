"""Instruction data: chat templates rendered as transformers renders them, the loss only on
completion / assistant tokens, truncation counted, bad lines named, the held-out set split the
same way on every mesh."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from hybrid2d.config import JobConfig
from hybrid2d.data import EvalSet, build_run_data
from hybrid2d.data.chat import load_chat_template
from hybrid2d.data.instruct import build_instruction_arrays
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from tests.launch import recipe_error

transformers = pytest.importorskip("transformers")
from tests.workers.hf_chat import make_chat_model, make_tokenizer  # noqa: E402

# A template in the style of Llama/Mistral ones: bos_token, a system turn folded in, loop
# variables, a namespace, raise_exception on alternation, whitespace control.
OTHER_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}
{%- for message in messages if message['role'] != 'system' %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {{- '[INST] ' + (ns.system + '\\n\\n' if loop.first and ns.system else '') }}
        {{- message['content'] | trim + ' [/INST]' }}
    {%- else %}
        {{- ' ' + message['content'] | trim + eos_token }}
    {%- endif %}
{%- endfor %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 6 x 7?"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 6 x 7?"},
    ],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is 6 x 7?"},
        {"role": "assistant", "content": "42."},
        {"role": "user", "content": "  And 7 x 8?  "},
        {"role": "assistant", "content": '56, with ünïcode and "quotes" & <tags>.'},
    ],
]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """Two tokenizer directories: the ChatML template in tokenizer_config.json, and another
    template in chat_template.jinja (transformers 5's file) with bos/eos tokens."""
    root = tmp_path_factory.mktemp("tok")
    chatml = root / "chatml"
    make_tokenizer(str(chatml))
    other = root / "other"
    other.mkdir()
    shutil.copy(chatml / "tokenizer.json", other / "tokenizer.json")
    (other / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
            }
        )
    )
    (other / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    return {"chatml": chatml, "other": other}


@pytest.mark.parametrize("name", ["chatml", "other"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [False, True], ids=["no-gen", "gen-prompt"])
def test_chat_rendering_equals_transformers(tok_dirs, name, conv, gen):
    messages = CONVERSATIONS[conv]
    ours = load_chat_template(str(tok_dirs[name])).render(messages, add_generation_prompt=gen)
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dirs[name]))
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs


def write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def loss_text(tok, ds, i) -> str:
    ids = ds.ids[i][ds.targets[i]]
    return tok.decode(ids.tolist(), skip_special_tokens=False)


def test_loss_only_on_assistant_turns_and_completion(tok_dirs, tmp_path):
    d = tok_dirs["chatml"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    records = [
        {"messages": CONVERSATIONS[2]},
        {"prompt": "Q: 6 x 7? A:", "completion": " 42"},
    ]
    f = write_lines(tmp_path / "a.jsonl", records)
    ds = build_instruction_arrays([f], tok, load_chat_template(str(d)), 128)
    assert loss_text(tok, ds, 0) == (
        '42.<|im_end|>56, with ünïcode and "quotes" & <tags>.<|im_end|>'
    )
    assert loss_text(tok, ds, 1) == " 42<|endoftext|>"
    # The labels the loader hands out: the next token where it is a loss token, else -100.
    inputs, labels, *_ = ds.gather([0, 1])
    assert inputs.shape == labels.shape == (2, 128)
    assert torch.equal(labels != -100, torch.from_numpy(ds.targets[[0, 1], 1:]))
    keep = labels != -100
    assert torch.equal(labels[keep], torch.from_numpy(ds.ids[[0, 1], 1:].astype(np.int64))[keep])
    # The rendered text's tokens are what inference sees: ids equal the tokenized render.
    text = load_chat_template(str(d)).render(CONVERSATIONS[2])
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ds.ids[0][: len(ids)].tolist() == ids
    assert ds.stats.samples == 2 and ds.stats.truncated == 0
    assert ds.stats.loss_tokens == int(ds.targets[:, 1:].sum())


def test_prompt_completion_starts_with_the_bos_inference_puts_before_a_prompt(tok_dirs, tmp_path):
    """A tokenizer whose post-processor adds a BOS (Llama, Mistral): transformers' tokenizer call
    and tools/generate.py put it before a prompt, so a training sample starts with it too; with
    an empty prompt the completion's first token is then learnt after it."""
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(tok_dirs["chatml"] / "tokenizer.json"))
    bos = "<|im_start|>"
    tok.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    records = [{"prompt": "Q: 6 x 7? A:", "completion": " 42"}, {"prompt": "", "completion": "42"}]
    ds = build_instruction_arrays([write_lines(tmp_path / "a.jsonl", records)], tok, None, 64)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    for i, r in enumerate(records):
        reference = hf(r["prompt"])["input_ids"]  # what inference encodes
        assert reference[0] == tok.token_to_id(bos)
        assert ds.ids[i][: len(reference)].tolist() == reference
        assert not ds.targets[i][: len(reference)].any() and ds.targets[i][len(reference)]
        assert loss_text(tok, ds, i) == r["completion"] + "<|endoftext|>"
    # Without a post-processor nothing is added: the chatml tokenizer's samples start at the text.
    plain = Tokenizer.from_file(str(tok_dirs["chatml"] / "tokenizer.json"))
    ds = build_instruction_arrays([tmp_path / "a.jsonl"], plain, None, 64)
    assert ds.ids[0][0] == plain.encode("Q").ids[0]


def sentencepiece_style_tokenizer() -> Tokenizer:
    """A BPE like Llama 2's / Mistral's tokenizer.json: words learnt with their leading "▁",
    then the legacy normalizer ("▁" prepended, spaces as "▁") and no pre-tokenizer."""
    from tokenizers import models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    sums = [f"What is {a} + {b}? {a} + {b} = {a + b}." for a in range(30) for b in range(9)]
    tok.train_from_iterator(sums, trainer=trainer)
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


def test_a_completion_continues_the_prompt_as_one_text_would(tmp_path):
    """A SentencePiece-style tokenizer gives a text encoded alone a leading "▁": a completion
    " 12 + 4" encoded alone read as two spaces after the prompt. Now the sample's text tokens
    are those transformers gives prompt + completion, and its prompt tokens those inference
    gives the prompt."""
    tok = sentencepiece_style_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    records = [
        {"prompt": "What is 12 + 4?", "completion": " 12 + 4 = 16."},
        {"prompt": "What is 5 + 3?", "completion": "5 + 3 = 8."},  # the text has no space
    ]
    ds = build_instruction_arrays([write_lines(tmp_path / "a.jsonl", records)], tok, None, 64)
    for i, r in enumerate(records):
        text = hf(r["prompt"] + r["completion"], add_special_tokens=False)["input_ids"]
        prompt = hf(r["prompt"], add_special_tokens=False)["input_ids"]
        assert ds.ids[i][: len(text)].tolist() == text and text[: len(prompt)] == prompt
        assert ds.ids[i][len(text)] == tok.token_to_id("</s>")
        assert ds.targets[i][len(prompt) : len(text) + 1].all()
        assert not ds.targets[i][: len(prompt)].any()


def test_truncation_is_counted(tok_dirs, tmp_path):
    d = tok_dirs["chatml"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    long = {"prompt": "Q?", "completion": " the answer" * 40}
    f = write_lines(tmp_path / "t.jsonl", [long, {"prompt": "Q?", "completion": " 42"}])
    ds = build_instruction_arrays([f], tok, None, 32)
    assert ds.stats.truncated == 1 and ds.ids.shape == (2, 33)
    assert ds.targets[0].all() == False  # noqa: E712 - the prompt is not a loss token
    assert ds.targets[0, -1]


RAISING = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}"  # noqa: E501

BAD = {
    "neither-format": ({"text": "hello"}, "neither prompt/completion nor messages"),
    "unknown-role": (
        {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
        "unknown role 'bot'",
    ),
    "template-fails": (
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
        },
        "System role not supported",
    ),  # fmt: skip
    "no-loss-tokens": ({"messages": [{"role": "user", "content": "q"}]}, "no loss tokens"),
    "empty-completion": ({"prompt": "q", "completion": ""}, "no loss tokens"),
    "not-json": ("{oops", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_instruction_line_names_file_and_line(tok_dirs, tmp_path, case):
    d = tok_dirs["chatml"]
    if case == "template-fails":
        d = tmp_path / "raising"
        shutil.copytree(tok_dirs["chatml"], d)
        (d / "chat_template.jinja").write_text(RAISING)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    record, says = BAD[case]
    good = {"prompt": "q", "completion": "a"}
    f = tmp_path / "bad.jsonl"
    line = record if isinstance(record, str) else json.dumps(record)
    f.write_text(json.dumps(good) + "\n\n" + line + "\n")
    with pytest.raises(ConfigError) as e:
        build_instruction_arrays([f], tok, load_chat_template(str(d)), 64)
    msg = str(e.value)
    assert f"{f}:3" in msg and says in msg and "\n" not in msg, msg


def test_bad_instruction_data_is_one_error_line_and_exit_2(tok_dirs, tmp_path):
    hf_dir = tmp_path / "model"
    make_chat_model(str(hf_dir))
    f = tmp_path / "bad.jsonl"
    bad = {"messages": [{"role": "x", "content": "a"}]}
    f.write_text('{"prompt": "q", "completion": "a"}\n' + json.dumps(bad) + "\n")
    error = recipe_error(
        "--checkpoint.init_from", f"hf:{hf_dir}", "--data.path", str(f), "--train.seq_len", "32",
        "--data.cache_dir", str(tmp_path / "cache"), "--metrics.run_dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert f"{f}:2" in error and "unknown role 'x'" in error


@pytest.mark.parametrize("dp,micro", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_eval_set_is_split_the_same_way_on_every_mesh(dp, micro):
    class Rows:
        def __len__(self):
            return 7

        def gather(self, idx):
            idx = torch.as_tensor(np.asarray(idx), dtype=torch.long)
            return idx[:, None].expand(-1, 4).clone(), idx[:, None].expand(-1, 4).clone()

    seen, rounds = [], set()
    for rank in range(dp):
        batches = list(EvalSet(Rows(), "t").batches(rank, dp, micro))
        rounds.add(len(batches))
        for inputs, labels, *_ in batches:
            assert inputs.shape == labels.shape == (micro, 4)
            seen += [int(r[0]) for r in labels if r[0] != -100]
    assert sorted(seen) == list(range(7))
    assert len(rounds) == 1  # every rank runs the same number of forward passes


def test_val_fraction_holds_out_a_fixed_part(tok_dirs, tmp_path):
    f = tmp_path / "d.jsonl"
    write_lines(f, [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(40)])
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.tokenizer = str(f), str(tok_dirs["chatml"])
    cfg.data.cache_dir, cfg.data.val_fraction = str(tmp_path / "cache"), 0.1
    cfg.model.vocab_size, cfg.train.seq_len, cfg.train.global_batch = 384, 16, 4
    data = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    rows = data.val.dataset  # packed rows (data.packing packed) of the held-out samples
    assert data.kind == "instruct" and len(rows.dataset) == 4 and len(data.loader.dataset) == 36
    assert sorted(np.concatenate(rows.rows).tolist()) == [0, 1, 2, 3] and len(data.val) < 4
    held = set(rows.dataset.indices.tolist())
    assert not held & set(data.loader.dataset.indices.tolist())
    cfg.train.seed = 5  # the held-out part does not move with the training seed
    again = build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
    assert set(again.val.dataset.dataset.indices.tolist()) == held


def test_a_sample_whose_loss_tokens_lie_beyond_seq_len_is_dropped_and_counted(tok_dirs, tmp_path):
    tok = Tokenizer.from_file(str(tok_dirs["chatml"] / "tokenizer.json"))
    long_prompt = {"prompt": "why " * 50, "completion": " 42"}
    f = write_lines(tmp_path / "d.jsonl", [long_prompt, {"prompt": "Q?", "completion": " 42"}])
    ds = build_instruction_arrays([f], tok, None, 32)
    assert ds.stats.samples == 1 and ds.stats.dropped == 1 and ds.stats.truncated == 0
    only = write_lines(tmp_path / "e.jsonl", [long_prompt])
    with pytest.raises(ConfigError, match="holds no samples .1 have no loss token"):
        build_instruction_arrays([only], tok, None, 32)


@pytest.mark.parametrize(
    "settings,says",
    [
        ({"val_path": "v.jsonl", "val_fraction": 0.1}, "both name validation data"),
        ({"eval_every": 5}, "train.eval_every=5 needs validation data"),
    ],
)
def test_validation_settings_are_checked(settings, says):
    cfg = JobConfig(recipe="test")
    for key, value in settings.items():
        setattr(cfg.train if key == "eval_every" else cfg.data, key, value)
    with pytest.raises(ConfigError, match=says):
        RunLayout.build(cfg, 1)


def test_val_fraction_range_and_forced_instruct_format(tmp_path):
    from hybrid2d.cli import apply_overrides

    with pytest.raises(ConfigError, match="data.val_fraction=0.7 is out of range"):
        apply_overrides(JobConfig(), ["--data.val_fraction", "0.7"])
    f = tmp_path / "a.txt"
    f.write_text("hello")
    cfg = JobConfig(recipe="test")
    cfg.data.path, cfg.data.format = str(f), "instruct"
    cfg.data.cache_dir = str(tmp_path / "cache")
    with pytest.raises(ConfigError, match="data.format=instruct needs .jsonl files"):
        build_run_data(cfg, RunLayout.build(cfg, 1), 0, True, lambda: None)
