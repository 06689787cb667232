"""Checkpoints to and from whole-model form: plain state dicts and Hugging Face directories.

Single process, no DeepSpeed: fragments are assembled from the rank files directly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron_lite.checkpoint import store
from megatron_lite.checkpoint.checkpointer import architecture
from megatron_lite.checkpoint.hf_source import open_hf
from megatron_lite.checkpoint.manifest import listed_file, read_manifest, verify
from megatron_lite.checkpoint.mapped import CheckpointWeights, MappedFiles
from megatron_lite.checkpoint.shards import Assembler, Fragment, file_fragments, shape_mismatches
from megatron_lite.config.schema import ModelConfig
from megatron_lite.model import build_model

# Model fields outside ``ModelConfig.ARCHITECTURE`` that an export needs to compute what the model
# computes (and to write a config transformers accepts): the RoPE table's or learned positions'
# length and the norms' epsilon.
EXPORTED_BEYOND_ARCHITECTURE = ("max_seq_len", "norm_eps")
MODEL_FIELDS = (*ModelConfig.ARCHITECTURE, *EXPORTED_BEYOND_ARCHITECTURE)


def resolve(path: Path) -> Path:
    """A checkpoint directory, or a checkpoint root (then the one ``latest`` names)."""
    if (path / store.MANIFEST).is_file():
        return path
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist (give a step directory, or a "
                                f"checkpoint.dir whose '{store.LATEST}' names one)")
    latest = store.read_latest(path)
    if latest is None:
        raise store.CheckpointError(f"{path} is neither a checkpoint nor a directory with '{store.LATEST}'")
    return latest


def read_model(path: Path) -> tuple[dict, ModelConfig, dict[str, torch.Tensor]]:
    """(manifest, model config, full fp32 weights by plain-model name) of a verified checkpoint,
    the whole model assembled (``open_model`` assembles each weight when it is asked for)."""
    manifest, cfg, weights = open_model(path)
    return manifest, cfg, dict(weights.items())


def open_model(path: Path) -> tuple[dict, ModelConfig, CheckpointWeights]:
    """(manifest, model config, its weights, assembled when read) of a verified checkpoint.
    The manifest's model fields are compared with the shapes its fragments record before any
    weight is assembled: a field that does not describe them is refused by name."""
    path = resolve(path)
    manifest = read_manifest(path, required=("model", "data"))
    verify(path, manifest)
    fragments, mapped, files_of = [], MappedFiles(), {}
    for entry in manifest["files"]:
        file = listed_file(path, entry)
        state = store.load_rank_file(file)
        mapped.add(file)
        try:
            if not (isinstance(state, dict) and isinstance(state.get("fragments"), list)):
                raise ValueError("it holds no list of fragments")
            held = file_fragments(state, file.stat().st_size)
        except (KeyError, TypeError, ValueError) as e:
            raise store.CheckpointError(f"{file} is not a rank file of this format: {e}") from None
        fragments += held
        for f in held:
            files_of.setdefault(f.name, set()).add(str(file))
    model = manifest["model"]
    heads = model.get("n_heads"), model.get("n_kv_heads") or model.get("n_heads")
    try:
        assembler = Assembler(fragments, heads=heads if all(isinstance(h, int) and h > 0 for h in heads)
                              else None)
    except (TypeError, ValueError) as e:
        raise store.CheckpointError(f"{path}: {e}") from None
    fields = {k: v for k, v in manifest["model"].items() if k in MODEL_FIELDS}
    # An imported checkpoint records these fields; a trained one has them in its recipe, which
    # (as resolve_model does) takes the data's sequence length for a null max_seq_len.
    recipe = _recipe_model(manifest)
    for name in EXPORTED_BEYOND_ARCHITECTURE:
        if fields.get(name) is None and recipe.get(name) is not None:
            fields[name] = recipe[name]
    fields["max_seq_len"] = fields.get("max_seq_len") or manifest["data"].get("seq_length")
    try:
        cfg = ModelConfig(**fields)
        problem = _architecture_problem(cfg, assembler)
    except (TypeError, ValueError) as e:  # a recipe's field of the wrong type, a shape error
        problem = f"its model fields do not describe a model ({e})"
    if problem:
        raise store.CheckpointError(f"{path / store.MANIFEST}: {problem}; restore the manifest (or "
                                    "export the checkpoint it belongs to)")
    try:
        # Every weight is there and finite before a reader builds anything from one of them
        # (all ranks alike: found while building, one rank would fail alone).
        for name in assembler.by_name:
            assembler.check_values(name)
    except ValueError as e:
        raise store.CheckpointError(f"{path}: {e}") from None
    return manifest, cfg, CheckpointWeights(path, assembler, cfg.vocab_size, mapped, files_of)


def _architecture_problem(cfg: ModelConfig, assembler: Assembler) -> str | None:
    """The first model field that does not describe the checkpoint's weights, in words naming
    it (None when all do), from the fragments' recorded shapes alone: nothing is allocated, so
    a field that claims a gigantic model costs nothing. The fields sizing the embedding and the
    number of blocks are compared first; then every parameter with the model the fields build
    on the meta device."""
    shapes = {name: assembler.shape(name) for name in assembler.names()}
    emb = shapes.get("tok_emb.weight")
    if emb is None or len(emb) != 2:
        return "its files hold no tok_emb.weight (the manifest lists none that has it)"
    rows, width = emb
    if cfg.d_model != width:
        return f"model.d_model={cfg.d_model} does not match the weights (tok_emb.weight is {width} wide)"
    if cfg.vocab_size > rows:
        return (f"model.vocab_size={cfg.vocab_size} does not match the weights (tok_emb.weight has "
                f"{rows} rows)")
    blocks = {int(m.group(1)) for name in shapes if (m := re.match(r"blocks\.(\d+)\.", name))}
    if len(blocks) != cfg.n_layers or (blocks and max(blocks) != cfg.n_layers - 1):
        return (f"model.n_layers={cfg.n_layers} does not match the weights (they hold {len(blocks)} "
                "block(s))")
    if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.kv_heads:
        return (f"model.n_heads={cfg.n_heads} with model.n_kv_heads={cfg.n_kv_heads} does not divide "
                f"model.d_model={cfg.d_model} into heads (nor the heads into groups)")
    pos = shapes.get("pos_emb.weight")
    if cfg.position == "learned" and pos is not None and pos[0] != cfg.max_seq_len:
        return (f"model.max_seq_len={cfg.max_seq_len} does not match the weights (pos_emb.weight has "
                f"{pos[0]} rows)")
    try:
        expected = {name: tuple(p.shape) for name, p in build_model(cfg, device="meta").named_parameters()}
    except Exception as e:  # a module's own check (heads that do not divide the width, ...)
        return f"its model fields do not build a model ({type(e).__name__}: {e})"
    mismatched = shape_mismatches(expected, assembler, cfg.vocab_size)
    extra = sorted(shapes.keys() - expected.keys())
    if not mismatched and not extra:
        return None
    name = (mismatched[0].split(" ", 1)[0]) if mismatched else extra[0]
    what = mismatched[0] if mismatched else f"{name} is in the checkpoint, not in this model"
    fields = " or ".join(f"model.{f}={getattr(cfg, f)!r}" for f in _deciding(name))
    more = len(mismatched) + len(extra) - 1
    return (f"{fields} does not match the weights ({what}"
            + (f"; and {more} more parameter(s)" if more else "") + ")")


def _deciding(name: str) -> tuple[str, ...]:
    """The model fields that decide whether parameter ``name`` exists and its shape."""
    rules = (("lm_head.", ("tie_embeddings",)), ("pos_emb.", ("position", "max_seq_len")),
             ("norm.bias", ("norm", "bias")), (".bias", ("bias", "qkv_bias")),
             ("q_norm.", ("qk_norm", "n_heads")), ("k_norm.", ("qk_norm", "n_heads")),
             ("gate_up_proj.", ("activation", "ffn_hidden")), ("gate_proj.", ("activation", "ffn_hidden")),
             ("mlp.", ("ffn_hidden", "activation")), ("qkv_proj.", ("n_kv_heads", "n_heads")),
             # (The separate projections of a checkpoint written before they were fused.)
             ("k_proj.", ("n_kv_heads", "n_heads")), ("v_proj.", ("n_kv_heads", "n_heads")),
             ("q_proj.", ("n_heads", "d_model")))
    return next((fields for part, fields in rules if part in name), ("d_model",))


def _recipe(manifest: dict) -> dict:
    """The recipe a checkpoint was trained with ({} for none)."""
    try:
        recipe = yaml.safe_load(manifest.get("config") or "")
    except yaml.YAMLError:
        return {}
    return recipe if isinstance(recipe, dict) else {}


def _recipe_model(manifest: dict) -> dict:
    """The ``model`` section of the recipe a checkpoint was trained with ({} for none)."""
    model = _recipe(manifest).get("model")
    return model if isinstance(model, dict) else {}


def export_hf(path: Path, out: Path, tokenizer: Path | None = None,
              log: Callable[[str], None] | None = None) -> Path:
    """Write a directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads
    (safetensors + config), with the tokenizer files when ``tokenizer`` is a Hugging Face
    tokenizer directory. Its special-token ids are the imported model's, else those of the
    tokenizer the recipe names (or of ``tokenizer``); an id outside the vocabulary is written as
    null (``log`` says so). Raises unless every file it says it wrote is there."""
    from transformers import AutoModelForCausalLM

    from megatron_lite.model.hf_convert import to_hf

    # transformers only logs this case and writes nothing: refused before any work.
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory; give a new or existing directory "
                         "for the export")
    manifest, cfg, weights = read_model(path)
    if cfg.tie_embeddings:
        weights["lm_head.weight"] = weights["tok_emb.weight"]
    config_ids, generation_ids = _token_ids(manifest, cfg.tokenizer_vocab_size or cfg.vocab_size,
                                            tokenizer, log or (lambda _: None))
    hf_cfg, hf_sd = to_hf(weights, cfg, config_ids)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in model.state_dict() if k not in hf_sd and not k.endswith("attn.bias")
               and not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing:
        raise ValueError(f"no weights for {missing[:5]} in the converted checkpoint")
    if getattr(model, "generation_config", None) is not None:
        for key, value in {**config_ids, **generation_ids}.items():
            setattr(model.generation_config, key, value)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None and (tokenizer / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    _check_written(out)
    return out


def _check_written(out: Path) -> None:
    """The files an export consists of are in ``out``: transformers reports some failures to
    write (a path that is not a directory) in its log only."""
    index = out / "model.safetensors.index.json"
    weights = [out / "model.safetensors"]
    if index.is_file():
        try:
            weights = [out / name for name in set(json.loads(index.read_text())["weight_map"].values())]
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise OSError(f"the export in {out} is incomplete: {index.name} cannot be read ({e})") from None
    absent = [p.name for p in [out / "config.json", *weights] if not p.is_file()]
    if absent:
        raise OSError(f"the export to {out} did not write {', '.join(sorted(absent))} (see the messages "
                      "above); nothing usable is there")


TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special-token ids an export always writes: transformers' config classes have defaults of
their own for them (GPT-2's 50256, Llama's 1 and 2) that belong to other vocabularies."""


def _token_ids(manifest: dict, vocab: int, tokenizer: Path | None,
               log: Callable[[str], None]) -> tuple[dict, dict]:
    """(the config's special-token ids, the generation config's) for an export: an imported
    model's own (its generation config's as it had them), else from the tokenizer the recipe
    names when it is on disk, else from ``tokenizer``; never an id outside the vocabulary (null
    instead)."""
    config_ids = manifest.get("token_ids")
    generation_ids = manifest.get("generation_token_ids") or {}
    if config_ids is None:
        config_ids = _tokenizer_ids(manifest, tokenizer, log)
    config_ids = {**dict.fromkeys(TOKEN_ID_FIELDS), **config_ids}
    return ({k: _in_vocabulary(k, v, vocab, log) for k, v in config_ids.items()},
            {k: _in_vocabulary(k, v, vocab, log) for k, v in generation_ids.items()})


def _tokenizer_ids(manifest: dict, tokenizer: Path | None, log: Callable[[str], None]) -> dict:
    """bos and eos ids of the recipe's tokenizer when it is on disk (never the network), else of
    the tokenizer directory given to the export; {} when neither is there."""
    from megatron_lite.data.tokenizers import load_tokenizer

    recipe = _recipe(manifest)
    data = recipe.get("data") if isinstance(recipe.get("data"), dict) else {}
    spec = data.get("tokenizer") if isinstance(data.get("tokenizer"), dict) else {}
    candidates = []
    if isinstance(spec.get("type"), str) and isinstance(spec.get("model"), str):
        candidates.append((spec["type"], Path(spec["model"])))
    if tokenizer is not None:
        candidates.append(("huggingface", tokenizer))
    for kind, where in candidates:
        if not where.exists():
            continue
        try:
            tok = load_tokenizer(kind, where)
        except Exception as e:  # a tokenizer that cannot load costs the ids, not the export
            log(f"warning: no special-token ids from the tokenizer {where} ({type(e).__name__}: {e})")
            continue
        return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eod_id}
    return {}


def _in_vocabulary(key: str, value: int | list[int] | None, vocab: int,
                   log: Callable[[str], None]) -> int | list[int] | None:
    """``value`` (an id or a list of ids) without the ids outside ``range(vocab)``; None when
    none is left."""
    ids = value if isinstance(value, list) else [value]
    inside = [i for i in ids if isinstance(i, int) and 0 <= i < vocab]
    if len(inside) < len([i for i in ids if i is not None]):
        log(f"warning: {key}={value} names ids outside the vocabulary of {vocab}; written as "
            f"{inside if isinstance(value, list) and inside else 'null'}")
    if isinstance(value, list):
        return inside or None
    return inside[0] if inside else None


def read_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """(our config, our fp32 state dict, transformers' config) of a Hugging Face model directory
    (or Hub id, where the network allows). What this model cannot compute is refused from the
    config alone, before any weight is read. The files are read directly, one block at a time
    into our names (``hf_source``): no transformers model is built (which would hold the weights
    twice, and which some transformers releases build only with accelerate installed)."""
    cfg, weights, hf_config = open_hf(hf_dir)
    return cfg, weights.read_all(), hf_config


def import_hf(hf_dir: Path, root: Path) -> Path:
    """A step-0 checkpoint in ``root`` holding the weights of a Hugging Face Llama, Qwen2, Qwen3 or
    GPT-2 directory (Adam moments zero): ``pretrain.py RECIPE checkpoint.dir=ROOT`` starts from it.
    Its manifest records the model fields beyond the architecture that ``export_hf`` writes back,
    so an import then export gives the original config's architecture fields."""
    cfg, sd, hf_config = read_hf(hf_dir)
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
        # The model's own special tokens, which an export writes back (transformers' defaults
        # for its class belong to another vocabulary).
        "token_ids": _special_ids(hf_config.to_dict()),
    }
    generation = _generation_ids(hf_dir)
    if generation:
        manifest["generation_token_ids"] = generation
    return store.commit(root, tmp, manifest)


def _special_ids(settings: dict) -> dict:
    """The special-token ids (``*_token_id``) of a transformers config's settings that are ids,
    lists of ids or null."""
    def is_ids(v) -> bool:
        return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (
            isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v))

    return {k: v for k, v in settings.items() if k.endswith("_token_id") and is_ids(v)}


def _generation_ids(hf_dir: Path) -> dict:
    """The special-token ids of ``hf_dir``'s generation config where it has one (a chat model's
    eos list, say): the ids it sets, not null."""
    from transformers import GenerationConfig

    try:
        settings = GenerationConfig.from_pretrained(hf_dir).to_dict()
    except Exception:  # none there (most models without one): the config's ids serve
        return {}
    return {k: v for k, v in _special_ids(settings).items() if v is not None}
