"""Tiny PEFT LoRA adapters for tests: random A and B (PEFT starts B at zero) on every
attention and MLP projection of a tiny transformers Llama, saved as adapter folders, and
the merged models (`merge_and_unload`) the logitloop rows must equal."""

from __future__ import annotations

import copy
from pathlib import Path

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base, directory: Path, *, rank: int, alpha: float, seed: int, targets=TARGETS, **config
):
    """Save a PEFT LoRA adapter of `rank` on `base` (a transformers model, not changed)
    with random non-zero A and B on `targets`; returns the merged transformers model."""
    import peft
    import torch

    torch.manual_seed(seed)
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), **config)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return model.merge_and_unload().eval()


def torch_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from a transformers model (no EOS)."""
    import torch

    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lp = hf(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids[len(prompt) :], lps
