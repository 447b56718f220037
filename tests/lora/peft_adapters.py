"""Tiny PEFT LoRA adapters for tests: random A and B (PEFT starts B at zero) on every
attention and MLP projection of a tiny transformers Llama, saved as adapter folders, and
the merged models (`merge_and_unload`) the logitloop rows must equal; and an adapter
folder for the shipped model written without PEFT (`shipped_model_adapter`)."""

from __future__ import annotations

import copy
import json
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


def shipped_model_adapter(folder, seed: int):
    """A PEFT adapter folder for the shipped model (4 layers, hidden 256): rank 8 on
    every layer's up_proj, written as adapter_config.json and safetensors."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    name = "base_model.model.model.layers.{}.mlp.up_proj.lora_{}.weight"
    tensors = {}
    for layer in range(4):
        tensors[name.format(layer, "A")] = rng.normal(0, 0.3, (8, 256)).astype(np.float32)
        tensors[name.format(layer, "B")] = rng.normal(0, 0.3, (704, 8)).astype(np.float32)
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["up_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
