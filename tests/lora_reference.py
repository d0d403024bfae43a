"""The independent LoRA reference: HF transformers' LlamaForCausalLM wrapped by PEFT, trained
with torch's SGD on the same batches, in one process."""

from __future__ import annotations

import peft
import torch
import torch.nn.functional as F
import transformers

from hybrid2d.checkpoint.hf import hf_config_from_model
from hybrid2d.config import JobConfig, LoraConfig, ModelConfig
from hybrid2d.models.llama import Llama
from hybrid2d.parallel.lora import BASE_DTYPES, apply_lora, init_adapters, is_adapter


def odd_model() -> ModelConfig:
    """Odd sizes (3 heads of 10, 1 kv head, ffn 70, vocab 97) that still split over tp = 2 / 4
    where tp needs it: heads and ffn for tp 2 only, so the multi-process test uses its own."""
    return ModelConfig(
        dim=30, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=70, vocab_size=97, init_std=0.1
    )


def tp4_model() -> ModelConfig:
    """Sizes that split over tp = 4 (heads, kv heads, ffn, vocabulary) yet are not round."""
    return ModelConfig(
        dim=40, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=44, vocab_size=100, init_std=0.1
    )


def lora_settings(rank: int = 5, base_dtype: str = "fp32", targets: str = "all-linear"):
    return LoraConfig(rank=rank, alpha=7.0, dropout=0.0, targets=targets, base_dtype=base_dtype)


def ours(cfg: ModelConfig, lcfg: LoraConfig, seed: int) -> Llama:
    """Our plain model with adapters: the seeded init, PEFT's initial adapters."""
    model = Llama(cfg)
    model.init_weights(seed)
    apply_lora(model, lcfg)
    init_adapters(model, seed)
    return model


def randomize_b(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """B starts at 0 (PEFT's init), where A's gradient is zero and the adapters change nothing:
    a random B makes both count. Returns `model`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, std)
    return model


def peft_twin(model: Llama, lcfg: LoraConfig) -> torch.nn.Module:
    """PEFT's model over transformers' class, with `model`'s base and adapters copied in."""
    hf_cfg = hf_config_from_model(model.cfg)
    arch = hf_cfg["architectures"][0]
    config = transformers.AutoConfig.for_model(**hf_cfg)
    config.architectures = [arch]
    hf = getattr(transformers, arch)(config)
    base = {n: p for n, p in model.state_dict().items() if not is_adapter(n)}
    hf.load_state_dict({n: p.float() for n, p in base.items()}, strict=True)
    for p in hf.parameters():
        p.data = p.data.to(BASE_DTYPES[lcfg.base_dtype])
    targets = "all-linear" if lcfg.targets == "all-linear" else lcfg.target_names()
    pcfg = peft.LoraConfig(
        r=lcfg.rank, lora_alpha=lcfg.alpha, lora_dropout=lcfg.dropout, target_modules=targets
    )
    twin = peft.get_peft_model(hf, pcfg)
    adapters = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    for name, p in twin.named_parameters():
        if p.requires_grad:
            ours_name = name.removeprefix("base_model.model.").replace(".default", "")
            p.data.copy_(adapters.pop(ours_name).detach().float())
    assert not adapters, f"PEFT has no twin of {sorted(adapters)}"
    return twin


def peft_adapters(twin) -> dict[str, torch.Tensor]:
    """PEFT's trainable tensors under our names."""
    return {
        n.removeprefix("base_model.model.").replace(".default", ""): p
        for n, p in twin.named_parameters()
        if p.requires_grad
    }


def mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def train_peft(twin, batches, lr: float) -> dict:
    """SGD steps of PEFT's model on whole batches: losses, the last step's gradients, final
    adapters."""
    opt = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=lr)
    losses, grads = [], None
    for inputs, labels in batches:
        loss = mean_loss(twin(input_ids=inputs).logits, labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in peft_adapters(twin).items()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters = {n: p.detach().clone() for n, p in peft_adapters(twin).items()}
    return {"losses": losses, "grads": grads, "adapters": adapters}


def lora_job(
    model: ModelConfig, lcfg: LoraConfig, steps: int = 10, lr: float = 0.5, seed: int = 3
) -> JobConfig:
    """Trainer settings for LoRA parity: plain SGD, constant lr, no clipping."""
    cfg = JobConfig(recipe="tiny-lora", model=model, lora=lcfg)
    t = cfg.train
    t.steps, t.global_batch, t.micro_batch, t.seq_len = steps, 4, 0, 8
    t.optimizer, t.grad_clip, t.seed, t.lr = "sgd", 0.0, seed, lr
    t.warmup_steps, t.min_lr_ratio = 0, 1.0
    cfg.metrics.tensorboard = False
    cfg.metrics.progress_bar = False
    return cfg
