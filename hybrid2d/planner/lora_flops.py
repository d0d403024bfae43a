"""FLOPs a LoRA step (lora.rank > 0) executes, per training token: what the planner's compute
term prices instead of full fine-tuning's 6 x weights.

A frozen base linear computes no weight gradient: 2 FLOPs per weight and token forward, 2 more
for the input gradient, and those only where its input needs a gradient. That is not the case
at the start of the first block (the frozen embedding's output): there a layer's input needs a
gradient only once an adapter upstream in the block has made the activation depend on a
trained weight, and attention's backward computes only the gradients of q, k, v that need one.
Each adapter (A [rank, in], B [out, rank]) costs 2 x rank x (in + out) forward, the same for
its two weight gradients, 2 x rank x out for the gradient of its low-rank activation, and
2 x rank x in for its input's gradient where the input needs one.

Full checkpointing reruns each block's forward up to the last tensor backward keeps, as
non-reentrant checkpointing does: the block's matmuls but the last one (down's base matmul
without a down adapter; with one, its B, whose output feeds nothing kept) and the attention.
Counted against torch's FlopCounterMode on a LoRA step (tests/test_plan_lora.py).
"""

from __future__ import annotations

import dataclasses

from hybrid2d.config import LoraConfig, ModelConfig
from hybrid2d.metrics import attended_keys, flops_per_token

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the rest are row-parallel
KV = ("k_proj", "v_proj")


def linear_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a block."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return {
        "q_proj": (m.dim, q),
        "k_proj": (m.dim, kv),
        "v_proj": (m.dim, kv),
        "o_proj": (q, m.dim),
        "gate_proj": (m.dim, m.ffn_dim),
        "up_proj": (m.dim, m.ffn_dim),
        "down_proj": (m.ffn_dim, m.dim),
    }


def _block(m: ModelConfig, targets: set[str], rank: int, input_grad: bool) -> dict[str, float]:
    """One block's matmul FLOPs per token (base, adapters A-side and B-side, recompute) and
    attention FLOPs per attended (query, key) pair, given whether its input needs a gradient."""
    shapes = linear_shapes(m)
    needs = {}  # name -> whether the layer's input needs a gradient

    def out_grad(name: str, inp: bool) -> bool:
        needs[name] = inp
        return inp or name in targets

    q, k, v = (out_grad(n, input_grad) for n in ("q_proj", "k_proj", "v_proj"))
    scores = q or k
    heads_hd = m.n_heads * m.head_dim
    # Forward: scores and weighted sum, 2 x head_dim each; backward: the gradients of the
    # attention weights (when q or k needs one), of v, q and k, each only where needed.
    attention = heads_hd * (4 + 2 * (scores + v + q + k))
    attn_out = scores or v
    o = out_grad("o_proj", attn_out)
    residual = input_grad or o
    gate, up = out_grad("gate_proj", residual), out_grad("up_proj", residual)
    down = out_grad("down_proj", gate or up)

    base = adapters = forward = replicated = kv = 0.0
    for name, (i, o) in shapes.items():
        base += (2 + 2 * needs[name]) * i * o
        kv += (2 + 2 * needs[name]) * i * o if name in KV else 0
        forward += 2 * i * o
        if name in targets:
            a_side = (4 + 2 * needs[name]) * rank * i  # forward, A's gradient, input's
            b_side = 6 * rank * o  # forward, B's gradient, the low-rank activation's
            adapters += a_side + b_side
            forward += 2 * rank * (i + o)
            # Every tp rank computes whole the side it holds replicated.
            replicated += a_side if name in COLUMN else b_side
            kv += b_side if name in KV else 0  # past the kv heads, B's rows of the rank's head
    down_in, down_out = shapes["down_proj"]
    last = 2 * rank * down_out if "down_proj" in targets else 2 * down_in * down_out
    return {
        "matmul": base + adapters,
        "forward": forward,
        "recompute": forward - last,
        "attention": attention,
        "attention_forward": 4 * heads_hd,
        "block_output_grad": residual or down,
        "replicated_side": replicated,
        "kv": kv,
    }


def lora_flops(
    m: ModelConfig, lcfg: LoraConfig, seq_len: int, activation_checkpoint: str, tp: int = 1
) -> dict[str, float]:
    """`planner.model.flops` of a LoRA step: FLOPs per training token of the matmuls and the
    attention executed, forward alone, what checkpointing recomputes, and what tp ranks compute
    twice (per token of the rank's share): the adapters' replicated side (column layers' A,
    row layers' B) on every rank, and past the kv heads the k/v projections and their
    adapters' B rows of the rank's kv head, as in full fine-tuning. `model` stays the model's
    FLOPs (flops_per_token: the MFU numerator)."""
    targets = set(lcfg.target_names())
    matmul = attention = fwd_mm = fwd_attn = rec_mm = rec_attn = replicated = 0.0
    grad = False  # the embedding is frozen: the first block's input needs no gradient
    kv_extra = max(0, tp - m.n_kv_heads) / m.n_kv_heads
    for layer in range(m.n_layers):
        blk = _block(m, targets, lcfg.rank, grad)
        pairs = _layer_keys(m, layer, seq_len) / seq_len if seq_len else 0.0
        matmul += blk["matmul"]
        attention += blk["attention"] * pairs
        fwd_mm += blk["forward"]
        fwd_attn += blk["attention_forward"] * pairs
        if activation_checkpoint == "full":
            rec_mm += blk["recompute"]
            rec_attn += blk["attention_forward"] * pairs
        elif activation_checkpoint == "selective" and tp > 1:  # the o projection's base
            rec_mm += 2 * m.dim * m.n_heads * m.head_dim
        replicated += (tp - 1) * blk["replicated_side"]
        replicated += kv_extra * blk["kv"]
        grad = blk["block_output_grad"]
    head = 2 * m.vocab_size * m.dim
    matmul += 2 * head  # a frozen lm_head: forward and its input's gradient
    fwd_mm += head
    return {
        "model": flops_per_token(m, seq_len),
        "matmul": matmul,
        "attention": attention,
        "forward_matmul": fwd_mm,
        "forward_attention": fwd_attn,
        "recompute_matmul": rec_mm,
        "recompute_attention": rec_attn,
        "replicated_matmul": replicated,
    }


def _layer_keys(m: ModelConfig, layer: int, seq_len: int) -> int:
    """`attended_keys` of one layer (its own window): the first block's attention backward
    differs from the others'."""
    types = m.layer_types[layer] if m.layer_types else m.layer_types
    return attended_keys(dataclasses.replace(m, n_layers=1, layer_types=types), seq_len)
