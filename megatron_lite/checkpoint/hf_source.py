"""A Hugging Face model directory's weights in our names, read one group at a time.

A group is one block's tensors (``model.layers.I.*`` or GPT-2's ``h.I.*`` become ``blocks.I.*``)
or the rest (embeddings, final norm, output layer). A parameter asked for reads and converts its
group; the group's other parameters wait for their turn, and the next group replaces them. A
rank that builds its model parameter by parameter (``checkpoint.init_from``) thus holds one
group of the source at a time, and a pipeline stage reads only its own blocks: an 8B model is
32 GB in fp32, on every rank of a node at once when each read it whole.

safetensors gives each tensor's shape without its data, so the names and shapes of our
parameters come from the conversion run on meta tensors, before any weight is read.
(transformers has no such reader: its loaders build the whole model.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_lite.checkpoint.mapped import MappedFiles
from megatron_lite.config.schema import ModelConfig

Convert = Callable[[Mapping[str, torch.Tensor], ModelConfig], dict[str, torch.Tensor]]

_HF_BLOCK = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_OUR_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def _group(pattern: re.Pattern, name: str) -> int | None:
    m = pattern.search(name)
    return int(m.group(1)) if m else None


def weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory, sharded or not, safetensors first."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (hf_dir / index).is_file():
            shards = sorted(set(json.loads((hf_dir / index).read_text())["weight_map"].values()))
            return [hf_dir / name for name in shards]
        if (hf_dir / single).is_file():
            return [hf_dir / single]
    raise FileNotFoundError(f"{hf_dir} holds no weights (model.safetensors, pytorch_model.bin or their "
                            "sharded indexes): download the model's weight files too")


class HFWeights(Mapping[str, torch.Tensor]):
    """Our fp32 parameters by name (``shapes``: their shapes, known without reading), read from
    ``files`` one group at a time through ``convert`` (``gpt2_from_hf``, ``llama_from_hf``)."""

    def __init__(self, files: list[Path], cfg: ModelConfig, convert: Convert):
        from safetensors import safe_open

        self.cfg, self.convert = cfg, convert
        # Each file stays open (mapped) while the weights are read: one deleted or replaced
        # meanwhile (a new download) cannot fail a rank halfway through its model.
        self.opened: dict[str, Any] = {}  # tensor name -> its safetensors file, open
        self.mapped: dict[str, torch.Tensor] = {}  # .bin files' tensors, memory-mapped
        # Each mapped file, checked for a change in place before its tensors are read.
        self.files, self.file_of = MappedFiles(), {}
        meta: dict[str, torch.Tensor] = {}
        for file in files:
            if file.suffix == ".safetensors":
                f = safe_open(str(file), framework="pt")
                self.files.add(file)
                for key in f.keys():  # noqa: SIM118 (not a dict)
                    self.opened[key], self.file_of[key] = f, str(file)
                    meta[key] = torch.empty(f.get_slice(key).get_shape(), device="meta")
            else:
                try:  # mapped: a tensor's pages are read when its group is
                    tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                    self.files.add(file)
                    self.file_of.update(dict.fromkeys(tensors, str(file)))
                except RuntimeError:  # a file of torch's legacy format cannot be mapped
                    tensors = torch.load(file, map_location="cpu", weights_only=True)
                self.mapped.update(tensors)
                meta.update({key: torch.empty(t.shape, device="meta") for key, t in tensors.items()})
        self.meta = meta
        self.hf_group = {key: _group(_HF_BLOCK, key) for key in meta}  # the block of each source tensor
        try:
            converted = convert(meta, cfg)
        except KeyError as e:
            raise ValueError(f"{files[0].parent}: its weights lack {e.args[0]}, which its config.json "
                             "implies") from None
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v.shape) for k, v in converted.items()}
        self._ready: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        if name not in self._ready:  # kept until another group is asked for (ZeRO-3's tiles ask again)
            self._ready = {}  # the previous group goes before the next is read
            self._ready = self._read(_group(_OUR_BLOCK, name))
        return self._ready[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def drop(self, name: str) -> None:
        """Leave ``name`` out (a tied output layer, which is the embedding)."""
        self.shapes.pop(name, None)

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every parameter, read group by group."""
        def block(name: str) -> int:
            found = _group(_OUR_BLOCK, name)
            return -1 if found is None else found

        return {name: self[name] for name in sorted(self.shapes, key=block)}

    def _read(self, group: int | None) -> dict[str, torch.Tensor]:
        """Our parameters of ``group``: its source tensors read, the rest left on meta, the
        conversion run over all of them, and the group's results taken."""
        source = dict(self.meta)
        keys = [key for key, its in self.hf_group.items() if its == group]
        self.files.check(sorted({self.file_of[key] for key in keys if key in self.file_of}))
        for key in keys:
            source[key] = self.mapped[key] if key in self.mapped else self.opened[key].get_tensor(key)
        out = {}
        for name, value in self.convert(source, self.cfg).items():
            if name in self.shapes and _group(_OUR_BLOCK, name) == group:
                if value.is_meta:  # a conversion that mixes groups: a bug here, never a wrong weight
                    raise RuntimeError(f"{name} needs source tensors outside its group ({group})")
                out[name] = value.float().contiguous()
        return out


def open_hf(hf_dir: Path | str) -> tuple[ModelConfig, HFWeights, Any]:
    """(our config, the weights in our names, transformers' config) of a Hugging Face model
    directory (or Hub id, where the network allows). What this model cannot compute is refused
    from the config alone, before any weight is read."""
    from transformers import AutoConfig

    from megatron_lite.model.hf_convert import config_from_hf, gpt2_from_hf, llama_from_hf

    hf_config = AutoConfig.from_pretrained(hf_dir)
    cfg = config_from_hf(hf_config)
    if not Path(hf_dir).is_dir():  # a Hub id (transformers found its config): its weight files
        from huggingface_hub import snapshot_download

        hf_dir = snapshot_download(str(hf_dir), allow_patterns=["*.json", "*.safetensors", "*.bin"])
    convert = gpt2_from_hf if cfg.position == "learned" else llama_from_hf
    return cfg, HFWeights(weight_files(Path(hf_dir)), cfg, convert), hf_config
