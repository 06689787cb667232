"""Checkpoints to and from whole-model form: plain state dicts and Hugging Face directories.

Single process, no DeepSpeed: fragments are assembled from the rank files directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.checkpointer import architecture
from megatron_lite.checkpoint.shards import Assembler, Fragment
from megatron_lite.config.schema import ModelConfig
from megatron_lite.model.transformer import VOCAB_PARAMETERS

# Model fields outside ``ModelConfig.ARCHITECTURE`` that an export needs to compute what the model
# computes (and to write a config transformers accepts): the RoPE table's or learned positions'
# length and the norms' epsilon.
EXPORTED_BEYOND_ARCHITECTURE = ("max_seq_len", "norm_eps")


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a checkpoint root (then the one ``latest`` names)."""
    if (path / store.MANIFEST).is_file():
        return path
    latest = store.read_latest(path)
    if latest is None:
        raise store.CheckpointError(f"{path} is neither a checkpoint nor a directory with '{store.LATEST}'")
    return latest


def read_model(path: Path) -> tuple[dict, ModelConfig, dict[str, torch.Tensor]]:
    """(manifest, model config, full fp32 weights by plain-model name) of a verified checkpoint."""
    path = resolve(path)
    manifest = store.read_manifest(path)
    store.verify(path, manifest)
    fragments = []
    for entry in manifest["files"]:
        state = store.load_rank_file(path / entry["name"])
        fragments += [Fragment.from_dict(d) for d in state["fragments"]]
    assembler = Assembler(fragments)
    fields = dict(manifest["model"])
    # The manifest's vocab_size is the tokenizer's; the rows past it are one layout's padding.
    weights = {name: assembler.full(name, "param")[:fields["vocab_size"]] if name in VOCAB_PARAMETERS
               else assembler.full(name, "param") for name in sorted(assembler.names())}
    # An imported checkpoint records these fields; a trained one has them in its recipe, which
    # (as resolve_model does) takes the data's sequence length for a null max_seq_len.
    recipe = _recipe_model(manifest)
    for name in EXPORTED_BEYOND_ARCHITECTURE:
        if fields.get(name) is None and recipe.get(name) is not None:
            fields[name] = recipe[name]
    fields["max_seq_len"] = fields.get("max_seq_len") or manifest.get("data", {}).get("seq_length")
    return manifest, ModelConfig(**fields), weights


def _recipe_model(manifest: dict) -> dict:
    """The ``model`` section of the recipe a checkpoint was trained with ({} for none)."""
    try:
        recipe = yaml.safe_load(manifest.get("config") or "")
    except yaml.YAMLError:
        return {}
    model = recipe.get("model") if isinstance(recipe, dict) else None
    return model if isinstance(model, dict) else {}


def export_hf(path: Path, out: Path, tokenizer: Path | None = None) -> Path:
    """Write a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads
    (safetensors + config), with the tokenizer files when ``tokenizer`` is a Hugging Face
    tokenizer directory."""
    from transformers import AutoModelForCausalLM

    from megatron_lite.model.hf_convert import to_hf

    _, cfg, weights = read_model(path)
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["tok_emb.weight"]
    hf_cfg, hf_sd = to_hf(weights, cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in model.state_dict() if k not in hf_sd and not k.endswith("attn.bias")
               and not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"no weights for {missing[:5]} in the converted checkpoint")
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None and (tokenizer / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def import_hf(hf_dir: Path, root: Path) -> Path:
    """A step-0 checkpoint in ``root`` holding the weights of a Hugging Face Llama, Qwen3 or GPT-2
    directory (Adam moments zero): ``pretrain.py RECIPE checkpoint.dir=ROOT`` starts from it.
    Its manifest records the model fields beyond the architecture that ``export_hf`` writes back,
    so an import then export gives the original config's architecture fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_lite.model.hf_convert import config_from_hf, from_hf

    # What this model cannot compute is refused from the config alone, before gigabytes of
    # weights are read.
    config_from_hf(AutoConfig.from_pretrained(hf_dir))
    cfg, sd = from_hf(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))
    fragments = []
    for name, tensor in sd.items():
        if cfg.tie_embeddings and name == "lm_head.weight":
            continue
        flat = tensor.detach().float().reshape(-1).clone()
        fragments.append(Fragment(name, tuple(tensor.shape), (), 0,
                                  {"param": flat, "exp_avg": torch.zeros_like(flat),
                                   "exp_avg_sq": torch.zeros_like(flat)}).to_dict())
    tmp = root / f".tmp-{store.step_name(0)}"
    tmp.mkdir(parents=True)
    state = {"rank": 0, "fragments": fragments, "rng": None,
             "trainer": {"scheduler": None, "adam_step": 0.0, "global_steps": 0, "global_samples": 0}}
    files = [store.write_rank_file(tmp, 0, state)]
    manifest = {
        "format": store.FORMAT_VERSION, "step": 0, "consumed_samples": 0, "consumed_tokens": 0,
        "topology": {"imported_from": str(hf_dir)},
        "model": {**architecture(cfg), **{k: getattr(cfg, k) for k in EXPORTED_BEYOND_ARCHITECTURE}},
        "data": {"seq_length": None, "tokenizer": None}, "files": files,
        "config": json.dumps({"imported_from": str(hf_dir)}),
    }
    return store.commit(root, tmp, manifest)
