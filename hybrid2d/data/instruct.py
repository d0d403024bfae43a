"""Instruction data: `.jsonl` lines of prompt/completion or chat messages, one sample each, with
the loss only on what the model should learn to write.

A line is `{"prompt": str, "completion": str}` (the sample is the tokenizer's BOS where its
post-processor adds one, as inference does before a prompt, + prompt + completion + EOS, the
completion tokenized as it continues the prompt; the loss counts the completion and the EOS) or
`{"messages": [{"role", "content"}, ...]}` (rendered with the tokenizer's chat template,
hybrid2d/data/chat.py; the loss counts the assistant turns, up to and including the template's
end-of-turn marker). Where an assistant turn is in the text is found by rendering the
conversation up to it with the generation prompt and up to its end: the turn is what the second
adds to the first. Tokens are labelled by their character offsets.

The cache holds one flat token array (memory-mapped by every rank); rows are made when
gathered, in one of two layouts (data.packing): padded, one sample per row of train.seq_len
positions (`gather`), or packed, several samples per row as rows.py places them (`pack`), each
sample its own document (attention stays inside it and RoPE positions restart at its start, so
its logits are those it has alone in a padded row). Either way the positions no sample fills
hold the pad id with labels -100 (ignore_index) that the loss does not count, and packed rows
give that tail a document of its own. A sample longer than seq_len + 1 tokens is cut to that
length and counted as truncated; one whose loss tokens all lie beyond it is dropped and counted.

Bad data (not UTF-8, not JSON, neither format, an unknown role, a template that refuses the
conversation, a sample with no loss tokens) is one ConfigError line naming the file and line.

Per sample the dataset keeps its loss-token count and whether it was truncated, so the figures of
any part of it (the training part when data.val_fraction holds some samples out) are exact.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import numpy as np
import torch
from tokenizers import Tokenizer

from hybrid2d.data.batch import Batch
from hybrid2d.data.chat import ChatTemplate, TemplateRenderError
from hybrid2d.data.corpus import INSTRUCTION_KEYS, not_utf8
from hybrid2d.data.tokenizer import eos_id, leading_special_ids, special_tokens_as_text
from hybrid2d.errors import ConfigError

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


def is_instruction_file(path: pathlib.Path) -> bool:
    """True if the first non-empty line of a .jsonl file has messages or prompt/completion."""
    if path.suffix != ".jsonl":
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        record = json.loads(first)
    except ValueError:  # not JSON, or an empty file
        return False
    return isinstance(record, dict) and bool({"messages", "prompt", "completion"} & record.keys())


@dataclass
class InstructStats:
    samples: int = 0
    truncated: int = 0  # samples longer than seq_len + 1 tokens, cut
    dropped: int = 0  # samples whose loss tokens all lie beyond seq_len + 1 tokens
    loss_tokens: int = 0
    tokens: int = 0  # tokens of the samples as kept (after truncation)
    positions: int = 0  # samples x seq_len

    @property
    def padding_fraction(self) -> float:
        used = self.tokens - self.samples  # a sample of n tokens fills n - 1 positions
        return 1.0 - used / max(self.positions, 1)

    def to_dict(self) -> dict:
        """What the run summary shows: the counts, and padding instead of tokens / positions."""
        shown = ("samples", "truncated", "dropped", "loss_tokens")
        return {k: getattr(self, k) for k in shown} | {
            "padding_fraction": round(self.padding_fraction, 4)
        }

    def describe(self, padded: bool = True) -> str:
        """The counts, and the padding one padded row per sample has (`padded`: the rows
        trained on; else the figure packing is compared with)."""
        padding = f"{self.padding_fraction:.0%} of positions"
        return (
            f"{self.samples} samples, {self.truncated} truncated to train.seq_len, "
            f"{self.dropped} dropped (no loss token within train.seq_len), "
            f"{self.loss_tokens} loss tokens, "
            + (f"padding {padding}" if padded else f"one row each would be {padding} padding")
        )


@dataclass(eq=False, repr=False)
class InstructionDataset:
    """Samples as one flat token array (and a flat mask of the tokens the loss counts) with
    offsets; rows are padded to seq_len + 1 only when gathered, so memory (and the cache on
    disk, memory-mapped) holds the data, not the padding."""

    tokens: np.ndarray
    targets_flat: np.ndarray
    offsets: np.ndarray
    seq_len: int
    pad_id: int
    stats: InstructStats  # of every sample, and the file's dropped lines
    sample_loss_tokens: np.ndarray  # int32 per sample
    sample_truncated: np.ndarray  # bool per sample

    def stats_of(self, indices, dropped: int = 0) -> InstructStats:
        """The figures of the samples `indices` (`dropped`: the dropped lines to count with
        them; the split into training and held-out parts happens after dropping)."""
        idx = np.asarray(indices, dtype=np.int64)
        lengths = self.offsets[idx + 1] - self.offsets[idx]
        return InstructStats(
            samples=len(idx),
            truncated=int(self.sample_truncated[idx].sum()),
            dropped=dropped,
            loss_tokens=int(self.sample_loss_tokens[idx].sum(dtype=np.int64)),
            tokens=int(lengths.sum()),
            positions=len(idx) * self.seq_len,
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [k, seq_len + 1] padded with pad_id, loss mask bool [k, seq_len + 1])."""
        idx = np.asarray(indices, dtype=np.int64)
        ids = np.full((len(idx), self.seq_len + 1), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), self.seq_len + 1), dtype=bool)
        for row, i in enumerate(idx):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            ids[row, : hi - lo] = self.tokens[lo:hi]
            mask[row, : hi - lo] = self.targets_flat[lo:hi]
        return ids, mask

    @property
    def ids(self) -> np.ndarray:
        """Every sample padded (for small sets and tests)."""
        return self.rows(range(len(self)))[0]

    @property
    def targets(self) -> np.ndarray:
        return self.rows(range(len(self)))[1]

    def sizes(self, indices) -> np.ndarray:
        """Positions each sample fills in a row (its tokens - 1)."""
        idx = np.asarray(indices, dtype=np.int64)
        return self.offsets[idx + 1] - self.offsets[idx] - 1

    def gather(self, indices) -> Batch:
        """One padded row per sample: inputs and labels [len(indices), seq_len], labels -100 off
        the loss; no documents (a row is one sequence)."""
        ids, mask = self.rows(indices)
        ids = torch.from_numpy(ids)
        labels = ids[:, 1:].masked_fill(~torch.from_numpy(mask[:, 1:]), IGNORE_INDEX)
        real = torch.from_numpy(self.sizes(indices))
        return Batch(ids[:, :-1].contiguous(), labels, None, real)

    def pack(self, rows: list[np.ndarray]) -> Batch:
        """Packed rows: row r holds the samples rows[r] one after another, sample j of a row
        document j, the tail after them padding (document len(rows[r]), labels -100)."""
        n, s = len(rows), self.seq_len
        ids = np.full((n, s), self.pad_id, dtype=np.int64)
        labels = np.full((n, s), IGNORE_INDEX, dtype=np.int64)
        docs = np.zeros((n, s), dtype=np.int64)
        real = np.zeros(n, dtype=np.int64)
        for r, samples in enumerate(rows):
            pos = 0
            for d, i in enumerate(samples):
                lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
                end = pos + hi - lo - 1
                if end > s:
                    raise ValueError(f"row {r} overflows seq_len={s}: samples {list(samples)}")
                ids[r, pos:end] = self.tokens[lo : hi - 1]
                target = self.tokens[lo + 1 : hi]
                labels[r, pos:end] = np.where(self.targets_flat[lo + 1 : hi], target, IGNORE_INDEX)
                docs[r, pos:end] = d
                pos = end
            docs[r, pos:] = len(samples)
            real[r] = pos
        t = torch.from_numpy
        return Batch(t(ids), t(labels), t(docs), t(real))


def _bad(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what}")


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise _bad(where, "messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(where, f"messages[{i}] has no role (expected {{role, content}})")
        if m["role"] not in ROLES:
            raise _bad(where, f"messages[{i}] has unknown role {m['role']!r}; use one of {ROLES}")
        if not isinstance(m.get("content"), str):
            raise _bad(where, f"messages[{i}] ({m['role']}) has no text content")
    return messages


def _render(template: ChatTemplate, messages, gen: bool, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt=gen)
    except TemplateRenderError as e:
        what = f"the chat template ({template.where}) fails to render it ({e})"
        raise _bad(where, what) from None


def chat_sample(template: ChatTemplate, messages: list[dict], where: str):
    """(text, [(start, end) character spans of the assistant turns])."""
    text = _render(template, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True, where)
        through = _render(template, messages[: i + 1], False, where)
        if not (through.startswith(before) and text.startswith(through)):
            raise _bad(
                where,
                f"the chat template ({template.where}) does not render the conversation up to "
                f"assistant turn {i} as a prefix of the whole, so the turn cannot be located",
            )
        end = len(through.rstrip())  # the end-of-turn marker counts, the newline after it not
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def encode_record(
    record,
    tok: Tokenizer,
    template: ChatTemplate | None,
    where: str,
    eos: int,
    bos: list[int] | tuple[int, ...] = (),
):
    """(token ids, loss mask) of one line's record; `bos` (leading_special_ids) starts a
    prompt/completion sample (a chat template writes its own)."""
    if not isinstance(record, dict):
        raise _bad(where, "expected a JSON object with prompt/completion or messages")
    if "messages" in record:
        text, spans = chat_sample(template, _messages(record, template, where), where)
        enc = tok.encode(text, add_special_tokens=False)
        ids = enc.ids
        mask = [any(lo <= s < hi for lo, hi in spans) for s, _ in enc.offsets]
        return ids, mask
    prompt, completion = _prompt_completion(record, where)
    with special_tokens_as_text(tok):
        p = tok.encode(prompt, add_special_tokens=False).ids if prompt else []
        c = _continuation(tok, prompt, p, completion)
    p = [*bos, *p]
    return p + c + [eos], [False] * len(p) + [True] * (len(c) + 1)


def _messages(record: dict, template: ChatTemplate | None, where: str) -> list[dict]:
    """A messages record's checked messages; an error if there is no template to render them."""
    if template is None:
        raise _bad(
            where,
            "has messages but data.tokenizer has no chat template (chat_template.jinja or "
            "tokenizer_config.json chat_template); use a tokenizer directory that has one",
        )
    return _check_messages(record["messages"], where)


def _prompt_completion(record: dict, where: str) -> tuple[str, str]:
    """A prompt/completion record's two strings, checked."""
    if "prompt" not in record and "completion" not in record:
        raise _bad(where, f"has neither prompt/completion nor messages (keys: {sorted(record)})")
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise _bad(where, "prompt and completion must both be strings")
    if not completion:
        raise _bad(where, "has no loss tokens (an empty completion)")
    return prompt, completion


def sample_texts(
    files: list[pathlib.Path], template: ChatTemplate | None, setting: str = "data.path"
):
    """The text of every sample as the model reads it (prompt + completion, or the rendered
    conversation), without BOS and EOS: what a tokenizer trained for the data learns from.
    Bad lines are the errors build_instruction_arrays gives."""
    for where, record in _records(files, setting):
        if "messages" in record:
            yield _render(template, _messages(record, template, where), False, where)
        else:
            yield "".join(_prompt_completion(record, where))


def _records(files: list[pathlib.Path], setting: str):
    """(where, record) of every non-empty line of the files: a JSON object; a line that is not
    UTF-8, not JSON, or plain text after instruction lines is an error naming it."""
    first: str | None = None  # where the first instruction line is, for the mixed-format error
    for path in files:
        # surrogateescape: a line that is not UTF-8 is reported with its number, not a traceback
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{setting}: {path}:{lineno}"
                if bad := not_utf8(line):
                    raise _bad(where, f"is not UTF-8 text ({bad}); convert the file to UTF-8")
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _bad(where, f"is not valid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise _bad(where, "expected a JSON object with prompt/completion or messages")
                if not INSTRUCTION_KEYS & record.keys() and first is not None:
                    raise _bad(
                        where,
                        f"has neither prompt/completion nor messages (keys: {sorted(record)}), "
                        f"while {first} is instruction data: mixed formats; a run reads one, so "
                        "put text and instruction lines in separate files",
                    )
                first = first or f"{path}:{lineno}"
                yield where, record


def _continuation(tok: Tokenizer, prompt: str, prompt_ids: list[int], completion: str) -> list:
    """The completion's tokens as they follow the prompt in one text: a SentencePiece-style
    tokenizer gives a text encoded alone a leading "▁", which after the prompt would read as
    one space too many. Where the tokens of prompt + completion do not start with the prompt's
    own (a token spans the boundary: inference would see the prompt's), the completion is
    encoded alone."""
    if prompt:
        joint = tok.encode(prompt + completion, add_special_tokens=False)
        k = len(prompt_ids)
        if joint.ids[:k] == prompt_ids and all(lo >= len(prompt) for lo, _ in joint.offsets[k:]):
            return joint.ids[k:]
    return tok.encode(completion, add_special_tokens=False).ids


def build_instruction_arrays(
    files: list[pathlib.Path],
    tok: Tokenizer,
    template: ChatTemplate | None,
    seq_len: int,
    setting: str = "data.path",
) -> InstructionDataset:
    """Every line of the files as a padded sample (see the module doc)."""
    eos, bos = eos_id(tok), leading_special_ids(tok)
    rows, masks, loss_counts, cut = [], [], [], []
    stats = InstructStats()
    for where, record in _records(files, setting):
        ids, mask = encode_record(record, tok, template, where, eos, bos)
        if not any(mask[1:]):  # the first token is never a label
            raise _bad(where, "has no loss tokens (no completion / assistant text)")
        truncated = len(ids) > seq_len + 1
        if truncated:
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            if not any(mask[1:]):  # the prompt fills the sequence: nothing to learn
                stats.dropped += 1
                continue
        rows.append(ids)
        masks.append(mask)
        loss_counts.append(sum(mask[1:]))
        cut.append(truncated)
    if not rows:
        why = f" ({stats.dropped} have no loss token within train.seq_len)" if stats.dropped else ""
        raise ConfigError(f"{setting}: {files[0] if files else ''} holds no samples{why}")
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    tokens = np.fromiter((t for r in rows for t in r), dtype=np.int32, count=int(offsets[-1]))
    targets = np.fromiter((m for ms in masks for m in ms), dtype=bool, count=int(offsets[-1]))
    loss = np.asarray(loss_counts, dtype=np.int32)
    truncated = np.asarray(cut, dtype=bool)
    ds = InstructionDataset(tokens, targets, offsets, seq_len, eos, stats, loss, truncated)
    ds.stats = ds.stats_of(np.arange(len(rows)), dropped=stats.dropped)
    return ds
