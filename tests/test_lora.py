"""LoRA (parallel/lora.py) against PEFT over transformers, the independent reference."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate, distribute_tensor

pytest.importorskip("peft")

from hybrid2d.checkpoint import layout  # noqa: E402
from hybrid2d.checkpoint.adapters import (  # noqa: E402
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    export_peft,
    load_peft,
    read_peft,
)
from hybrid2d.checkpoint.reader import read_metadata  # noqa: E402
from hybrid2d.config import JobConfig, LoraConfig, ModelConfig  # noqa: E402
from hybrid2d.errors import ConfigError  # noqa: E402
from hybrid2d.models.llama import Llama, copy_full_into  # noqa: E402
from hybrid2d.parallel.lora import (  # noqa: E402
    apply_lora,
    describe_lora,
    init_adapters,
    is_adapter,
    replicated_adapters,
)
from hybrid2d.parallel.tensor_parallel import apply_tp  # noqa: E402
from hybrid2d.planner.comm import analytic_step  # noqa: E402
from tests.launch import check_ok, run_ranks  # noqa: E402
from tests.lora_reference import (  # noqa: E402
    lora_job,
    lora_settings,
    mean_loss,
    odd_model,
    ours,
    peft_adapters,
    peft_twin,
    randomize_b,
    tp4_model,
    train_peft,
)
from tests.reference import global_batches  # noqa: E402
from tests.test_families import TOKENS, make_hf, ours_from_hf  # noqa: E402
from tests.test_plan import fake_tp_mesh  # noqa: E402


def train_ours(model, data, lr):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, grads = [], None
    for inputs, labels in data:
        loss = mean_loss(model(inputs), labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("targets", ["all-linear", "q_proj, v_proj,down_proj"])
def test_single_process_equals_peft(targets):
    """Logits, loss, adapter gradients and the adapters after 10 SGD steps equal PEFT's (fp32),
    and the frozen base is bit-identical after training."""
    lcfg = lora_settings(targets=targets)
    model = randomize_b(ours(odd_model(), lcfg, seed=3))
    twin = peft_twin(model, lcfg)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    job = lora_job(odd_model(), lcfg)
    data = list(global_batches(job))
    tokens = data[0][0]
    torch.testing.assert_close(model(tokens), twin(input_ids=tokens).logits, rtol=1e-5, atol=1e-6)

    got_losses, got_grads = train_ours(model, data, job.train.lr)
    ref = train_peft(twin, data, job.train.lr)
    assert sorted(got_grads) == sorted(ref["grads"])  # only the adapters are trained
    torch.testing.assert_close(got_losses, ref["losses"], rtol=1e-5, atol=0)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    for name, p in ref["adapters"].items():
        torch.testing.assert_close(adapters[name], p, rtol=1e-5, atol=1e-7, msg=name)
    for name, p in model.named_parameters():
        if not is_adapter(name):
            assert torch.equal(p, base[name]), f"{name} changed"
            assert p.grad is None, f"{name} has a gradient"


def test_bf16_base_with_fp32_adapters_equals_peft():
    """A bf16 base: activations in bf16, adapters computed and kept in fp32, as PEFT does."""
    lcfg = lora_settings(base_dtype="bf16")
    model = ours(odd_model(), lcfg, seed=5)
    assert {p.dtype for n, p in model.named_parameters() if is_adapter(n)} == {torch.float32}
    assert {p.dtype for n, p in model.named_parameters() if not is_adapter(n)} == {torch.bfloat16}
    twin = peft_twin(model, lcfg)
    job = lora_job(odd_model(), lcfg, steps=3)
    data = list(global_batches(job))
    losses, _ = train_ours(model, data, job.train.lr)
    ref = train_peft(twin, data, job.train.lr)
    # The first forward is the same arithmetic; after it the bf16 backward of the two
    # implementations rounds differently (at bf16's 4e-3 precision), so the bound is bf16's.
    assert abs(losses[0] - ref["losses"][0]) <= 1e-5 * ref["losses"][0]
    torch.testing.assert_close(losses, ref["losses"], rtol=1e-3, atol=0)
    mine = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    for name, p in peft_adapters(twin).items():
        torch.testing.assert_close(mine[name], p, rtol=2e-2, atol=2e-3, msg=name)


def test_bad_settings_are_one_line():
    cfg = JobConfig()
    cfg.lora.rank, cfg.lora.targets = 4, "q_proj,qproj"
    with pytest.raises(ConfigError, match=r"^lora\.targets='q_proj,qproj': 'qproj' matches no"):
        cfg.check_settings()
    cfg.lora.targets = "lm_head"
    with pytest.raises(ConfigError, match="matches no layer of a block"):
        cfg.check_settings()
    cfg.lora.targets = "q_proj"
    cfg.check_settings()
    model = Llama(odd_model())
    with pytest.raises(ConfigError, match=r"^lora\.rank=31 is larger than .*use a rank <= 10"):
        apply_lora(model, LoraConfig(rank=31, targets="all-linear"))
    with pytest.raises(ConfigError, match="lora.rank=-1 is out of range"):
        cfg.lora.rank = -1
        cfg.check_settings()


def test_kv_head_layers_take_adapters_and_other_placements_are_one_line():
    """tp 4 past 2 kv heads (k/v replicated, rank 3 computes kv head 1): k/v get replicated A
    and B, both in the one summed set, and rank 3's k/v output is its head's rows of
    base + B A x * scale; a layer placed any other way is one line naming it."""
    cfg = ModelConfig(dim=24, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=20, vocab_size=32)
    lcfg = lora_settings(rank=3)
    model = Llama(cfg)
    model.init_weights(0)
    attn = model.model.layers[0].self_attn
    full = {p: getattr(attn, p).weight.detach().clone() for p in ("k_proj", "v_proj")}
    gen = torch.Generator().manual_seed(0)
    lora_a = torch.randn(lcfg.rank, cfg.dim, generator=gen)
    lora_b = torch.randn(cfg.n_kv_heads * cfg.head_dim, lcfg.rank, generator=gen)
    x = torch.randn(2, 5, cfg.dim, generator=gen)
    rows = slice(cfg.head_dim, 2 * cfg.head_dim)  # kv head 1
    with fake_tp_mesh(3, 4) as mesh:
        apply_tp(model, mesh)
        apply_lora(model, lcfg, mesh)
        summed = {id(p) for p in replicated_adapters(model)}
        for name in ("k_proj", "v_proj"):
            proj = getattr(attn, name)
            for adapter, value in ((proj.lora_A, lora_a), (proj.lora_B, lora_b)):
                assert adapter.weight.placements == (Replicate(),), name
                assert id(adapter.weight) in summed, name
                with torch.no_grad():
                    copy_full_into(adapter.weight, value)
            want = F.linear(x, full[name][rows]) + F.linear(x, lora_b[rows] @ lora_a) * 7.0 / 3
            # fp32 sums in another order: off by up to 3e-7 of the largest output (300 random
            # draws), which fixed atol 1e-6 missed on 1 draw in 6 (outputs reach 150)
            scale = want.abs().max().item()
            torch.testing.assert_close(proj(x), want, rtol=1e-5, atol=1e-5 * scale)

        plain = Llama(cfg)  # q_proj replicated: no style of ours places a weight so
        q = plain.model.layers[0].self_attn.q_proj
        q.weight = torch.nn.Parameter(distribute_tensor(q.weight.detach(), mesh, [Replicate()]))
        with pytest.raises(ConfigError) as err:
            apply_lora(plain, lcfg, mesh)
        line = str(err.value)
        assert "\n" not in line and line.startswith("lora.targets='all-linear': "), line
        assert "model.layers.0.self_attn.q_proj is placed (Replicate(),)" in line, line


def test_rank_zero_changes_nothing():
    model = Llama(odd_model())
    before = dict(model.named_parameters())
    apply_lora(model, LoraConfig(rank=0))
    assert dict(model.named_parameters()) == before
    assert all(p.requires_grad for p in model.parameters())


def kv2_model():
    """tp4_model with 2 kv heads: on tp 4 k and v are replicated, 2 ranks per kv head."""
    return dataclasses.replace(tp4_model(), n_kv_heads=2)


def peft_reference(base_dtype: str, cfg=None) -> tuple[dict, dict]:
    """PEFT's 10 SGD steps from the trainer's own initial state, and that base."""
    cfg = cfg or tp4_model()
    lcfg = lora_settings(base_dtype=base_dtype)
    job = lora_job(cfg, lcfg)
    model = ours(cfg, lcfg, seed=job.train.seed)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter(n)}
    return train_peft(peft_twin(model, lcfg), list(global_batches(job)), job.train.lr), base


def reference_of(spec: str) -> tuple[str, bool]:
    """A lora_parity spec's PEFT reference: (base dtype, 2 kv heads)."""
    return ("bf16" if ":bf16" in spec else "fp32"), ":kv2" in spec


@pytest.mark.slow
def test_meshes_equal_single_process_peft(tmp_path):
    """One 4-rank launch trains (2, 2), (1, 4) and (4, 1) with an fp32 base, (2, 2) with a
    bf16 base and (2, 2) with parallel.compile (equal to the eager run to 1e-5): losses,
    last-step adapter gradients and final adapters equal PEFT's (1e-5 in fp32, bf16's
    precision with a bf16 base); the base is bit-identical and gets no gradient; the optimizer
    holds exactly the adapters. Collectives of a step against full fine-tuning on
    the same mesh: no activation all-gather or reduce-scatter added, one tp all-reduce of all
    the replicated adapters' gradient shards in place of the norms' all-reduces, and FSDP
    reduce-scatters of the adapters only."""
    out = tmp_path / "lora.pt"
    # (The worker also takes 2x2:compile, compiled blocks, which equal the eager run to 1e-5;
    # a cold compile costs this launch 30-40 s under load, so it is run by hand, not here.)
    specs = ["2x2", "1x4", "4x1", "2x2:bf16", "1x4:kv2"]
    check_ok(run_ranks(4, ["tests/workers/lora_parity.py", str(out), *specs], timeout=600))
    got = torch.load(out)
    for base_dtype, kv2 in sorted({reference_of(s) for s in specs}):
        ref, base = peft_reference(base_dtype, kv2_model() if kv2 else None)
        n_adapters = sum(p.numel() for p in ref["adapters"].values())
        rtol, atol = (1e-5, 1e-7) if base_dtype == "fp32" else (2e-2, 2e-3)
        for spec in [s for s in specs if reference_of(s) == (base_dtype, kv2)]:
            res = got[spec]
            assert res["trainable"] == n_adapters, spec
            assert res["grad_names"] == sorted(ref["grads"]), spec
            loss_rtol = 1e-5 if base_dtype == "fp32" else 1e-3
            torch.testing.assert_close(res["losses"], ref["losses"], rtol=loss_rtol, atol=0)
            for name, g in ref["grads"].items():
                torch.testing.assert_close(res["grads"][name], g, rtol=rtol, atol=atol, msg=name)
            for name, p in ref["adapters"].items():
                torch.testing.assert_close(res["adapters"][name], p, rtol=rtol, atol=atol)
            for name, p in base.items():
                assert torch.equal(res["base"][name], p), f"{spec}: {name} changed"
        if kv2:  # its training checkpoint exports PEFT's file: PEFT's names, shapes, adapters
            step = layout.latest_in_run(f"{out}.1x4-kv2")
            export_peft(step, read_metadata(step), tmp_path / "peft", torch.float32)
            exported = load_file(tmp_path / "peft" / ADAPTER_WEIGHTS)
            assert sorted(exported) == sorted(PEFT_PREFIX + n for n in ref["adapters"])
            for name, p in ref["adapters"].items():
                got_p = exported[PEFT_PREFIX + name]
                torch.testing.assert_close(got_p, p, rtol=rtol, atol=atol, msg=name)
    if "2x2:compile" in got:  # parallel.compile: the eager run's losses, gradients, adapters
        eager, compiled = got["2x2"], got["2x2:compile"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
        for key in ("grads", "adapters"):
            for name, value in eager[key].items():
                torch.testing.assert_close(compiled[key][name], value, rtol=1e-5, atol=1e-7)
    blocks = tp4_model().n_layers
    # The communication formula (planner/comm.py, LoRA's terms) gives what a step issued, count
    # and bytes, for every kind it gives full fine-tuning's (scalars: test_comm_report).
    for spec in ("2x2", "1x4", "4x1", "1x4:kv2"):
        dp, tp = map(int, spec.split(":")[0].split("x"))
        cfg = kv2_model() if spec.endswith(":kv2") else tp4_model()
        analytic = analytic_step(cfg, dp, tp, 4 // dp, 8, lora=lora_settings())
        measured = got[spec]["comm"]
        for kind, (count, nbytes) in analytic.items():
            if kind != "scalar_all_reduce":
                assert (measured["counts"][kind], measured["bytes"][kind]) == (count, nbytes), (
                    spec,
                    kind,
                    measured,
                    analytic,
                )
    for spec in ("2x2", "1x4"):
        lora, full = got[spec]["comm"], got[spec]["comm_full"]
        # None added; fewer, as backward stops at the frozen embedding (its all-gather and
        # the first attention's input-gradient reduce-scatter are not needed).
        for kind in ("tp_all_gather", "tp_reduce_scatter"):
            assert lora["counts"][kind] <= full["counts"][kind], (spec, kind, lora, full)
            assert lora["bytes"][kind] <= full["bytes"][kind], (spec, kind, lora, full)
            assert lora["counts"][kind] >= full["counts"][kind] - 1, (spec, kind, lora, full)
        # Replicated adapter weights (A of q, k, v, gate, up and B of o, down per block): one
        # all-reduce of all their gradients' dp shards (rank 0's: the first FSDP chunk), where
        # full fine-tuning all-reduces each norm weight's gradient (2 per block + the last);
        # the loss's all-reduces are the same.
        extra = lora["counts"]["tp_all_reduce"] - full["counts"]["tp_all_reduce"]
        assert extra == 1 - (2 * blocks + 1), (spec, lora, full)
        dp, dim, rank = int(spec[0]), tp4_model().dim, lora_settings().rank
        shards = blocks * (5 * -(-rank // dp) * dim + 2 * -(-dim // dp) * rank)
        loss_bytes = full["bytes"]["tp_all_reduce"] - (2 * blocks + 1) * dim * 4
        assert lora["bytes"]["tp_all_reduce"] == loss_bytes + shards * 4, (spec, lora, full)
    for spec in ("2x2", "4x1"):
        lora, full = got[spec]["comm"], got[spec]["comm_full"]
        # Adapters of rank 5 on 40-wide layers are a quarter of a block's weights here, and the
        # replicated pieces are not split by tp: 0.30 of full fine-tuning's bytes on 2x2.
        assert lora["bytes"]["fsdp_reduce_scatter"] < full["bytes"]["fsdp_reduce_scatter"] / 2


def test_adapters_from_a_peft_directory(tmp_path):
    """lora.init_from: adapters PEFT itself saved load into our model with PEFT's logits; an
    adapter of another rank or another architecture is one line."""
    lcfg = lora_settings(targets="q_proj,o_proj,up_proj")
    model = ours(odd_model(), lcfg, seed=1)
    twin = peft_twin(model, lcfg)
    with torch.no_grad():
        for p in peft_adapters(twin).values():
            p.normal_(0, 0.2)
    twin.save_pretrained(str(tmp_path / "adapter"))
    cfg = JobConfig(model=odd_model(), lora=lcfg)
    load_peft(model, read_peft(str(tmp_path / "adapter"), cfg.lora, cfg.model))
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens), twin(input_ids=tokens).logits, rtol=1e-5, atol=1e-6
        )

    with pytest.raises(ConfigError, match=r"the adapter has r=5, this run lora.rank=4; use"):
        read_peft(str(tmp_path / "adapter"), lora_settings(4, targets=lcfg.targets), cfg.model)
    with pytest.raises(ConfigError, match=r"fits no adapter of this model .*another"):
        read_peft(str(tmp_path / "adapter"), lcfg, tp4_model())
    with pytest.raises(ConfigError, match=r"^lora.init_from=.*no adapter_config.json there"):
        read_peft(str(tmp_path), lcfg, cfg.model)
    cfg.lora = LoraConfig(rank=0, init_from=str(tmp_path / "adapter"))
    with pytest.raises(ConfigError, match=r"^lora.init_from=.* needs adapters: set lora.rank"):
        cfg.check_settings()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma3"])
def test_every_family_equals_peft(family):
    """Adapters on each family's layers (Qwen2's biased q/k/v, Qwen3's and Gemma's q/k norms,
    Gemma's sandwich norms and gelu): logits and adapter gradients equal PEFT's."""
    hf = make_hf(family)
    model = ours_from_hf(hf)
    lcfg = lora_settings(rank=3)
    apply_lora(model, lcfg)
    init_adapters(model, 0)
    randomize_b(model)
    twin = peft_twin(model, lcfg)
    tokens, labels = TOKENS[:, :-1], TOKENS[:, 1:]
    ours_loss = mean_loss(model(tokens), labels)
    theirs_loss = mean_loss(twin(input_ids=tokens).logits, labels)
    torch.testing.assert_close(ours_loss, theirs_loss, rtol=1e-5, atol=0)
    ours_loss.backward()
    theirs_loss.backward()
    mine = dict(model.named_parameters())
    for name, p in peft_adapters(twin).items():
        torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_dropout_only_while_training_and_the_start_line():
    lcfg = LoraConfig(rank=4, alpha=8.0, dropout=0.5, targets="v_proj,down_proj")
    model = randomize_b(ours(odd_model(), lcfg, seed=2), std=0.5)
    plain = ours(odd_model(), LoraConfig(rank=4, alpha=8.0, targets="v_proj,down_proj"), seed=2)
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), plain.eval()(tokens))
        assert not torch.allclose(model.train()(tokens), plain(tokens))
    line = describe_lora(model, lcfg)
    # v_proj 30 -> 10 and down_proj 70 -> 30, rank 4, in 2 blocks
    trained = 2 * 4 * ((30 + 10) + (70 + 30))
    assert f"{trained:,} adapter parameters trained" in line, line
    assert line.startswith("lora: rank 4, alpha 8, dropout 0.5 on v_proj,down_proj;"), line
