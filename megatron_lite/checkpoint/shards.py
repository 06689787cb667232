"""What each rank writes and reads: its own slice of the weights and of the optimizer state.

Every parameter is addressed layout-free, by its ``ShardSpec``: its name in the plain model, its
cuts (the tensor-parallel slice and the tile it is, ``ShardSpec.cuts``) and the range of elements
of that piece, flattened, that this rank owns (its ZeRO partition; the whole piece without ZeRO).
A rank saves one *fragment* per parameter it owns: the fp32 weights and the Adam moments of that
range. Replicated state is saved once: a tensor-parallel-replicated parameter only by tensor
rank 0, an unsharded optimizer only by the first data-parallel replica, an HSDP shard group's
partitions only by its first copy, a weight tied across pipeline stages only by its owning stage.

Loading assembles, for each local parameter, the full tensors from whatever fragments the
checkpoint has (written by any layout) and cuts this rank's fragment out of them; so a
checkpoint loads into any tensor/pipeline/data-parallel size and ZeRO stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.checkpoint.shard_index import held_range
from megatron_lite.distributed.parallel_dims import ParallelDims
from megatron_lite.distributed.shard_spec import Cut, ShardSpec, joined, spec, whole_shape
from megatron_lite.engine import internals as ds
from megatron_lite.engine.internals import torch_optimizer
from megatron_lite.model.fused import fusable, fuse_parts, parts_of
from megatron_lite.model.transformer import VOCAB_PARAMETERS
from megatron_lite.optim.optimizer import first_step_state

STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class Fragment:
    name: str
    slice_shape: tuple[int, ...]
    """Shape of the piece (the full shape when the parameter is neither sliced nor tiled)."""
    cuts: tuple[Cut, ...]
    """Where the piece sits in the plain tensor (``ShardSpec.cuts``); () for the whole."""
    start: int
    """First element of the flattened piece held here."""
    tensors: dict[str, torch.Tensor]
    """``param`` (fp32 weights) and the optimizer moments, each 1-D of the fragment's length."""

    def to_dict(self) -> dict:
        return {"name": self.name, "slice_shape": list(self.slice_shape),
                "cuts": [list(c) for c in self.cuts], "start": self.start, "tensors": self.tensors}

    @staticmethod
    def from_dict(d: dict) -> Fragment:
        if "cuts" in d:
            cuts = tuple(tuple(c) for c in d["cuts"])
        else:  # written before tiling: at most one tensor-parallel slice, under "shard"
            cuts = (tuple(d["shard"]),) if d["shard"] is not None else ()
        return Fragment(d["name"], tuple(d["slice_shape"]), cuts, d["start"], d["tensors"])

    @property
    def numel(self) -> int:
        return self.tensors["param"].numel()

    def check(self, file_bytes: int | None = None) -> None:
        """Refuse a fragment whose recorded extent cannot be what its file holds, before any of
        its data is read or anything is allocated for it: its tensors (``file_bytes``, the
        file's real size, bounds them where given), the range ``start`` (``numel`` elements)
        inside its piece, and the cuts. Otherwise a corrupt or planted file could have the loader
        allocate terabytes for the piece or write outside it. ``ValueError`` naming the problem."""
        keys = ("param", *STATE_KEYS)
        tensors = self.tensors if isinstance(self.tensors, dict) else {}
        if not all(isinstance(tensors.get(k), torch.Tensor) and tensors[k].dim() == 1
                   and tensors[k].numel() == self.numel for k in keys):
            raise ValueError(f"fragment of '{self.name}': {', '.join(keys)} are not 1-D tensors of "
                             "one length")
        size = max(self.tensors[k].numel() * self.tensors[k].element_size() for k in keys)
        if file_bytes is not None and size > file_bytes:
            raise ValueError(f"fragment of '{self.name}' records {size} bytes, more than its file's "
                             f"{file_bytes}")
        if not (all(isinstance(n, int) and n >= 0 for n in self.slice_shape)
                and isinstance(self.start, int) and 0 <= self.start
                and self.start + self.numel <= math.prod(self.slice_shape)):
            raise ValueError(f"fragment of '{self.name}': elements {self.start}..{self.start + self.numel} "
                             f"lie outside its piece of shape {list(self.slice_shape)}")
        if not all(len(c) == 3 and all(isinstance(x, int) for x in c) and 0 <= c[0] < len(self.slice_shape)
                   and 0 <= c[1] < c[2] for c in self.cuts):
            raise ValueError(f"fragment of '{self.name}': cuts {list(self.cuts)} do not fit its piece "
                             f"of shape {list(self.slice_shape)}")


def file_fragments(state: dict, file_bytes: int) -> list[Fragment]:
    """The fragments of one rank file's ``state``, each checked against ``file_bytes``, the
    file's real size (``Fragment.check``)."""
    out = []
    for d in state["fragments"]:
        fragment = Fragment.from_dict(d)
        fragment.check(file_bytes)
        out.append(fragment)
    return out


def _owned_parameters(module: nn.Module, dims: ParallelDims) -> Iterable[nn.Parameter]:
    for p in module.parameters():
        if ds.is_pipe_replicated(p):
            continue  # the copy of a tied weight on a later pipeline stage
        if not spec(p).sharded and dims.tp_rank != 0:
            continue  # replicated across tensor ranks: rank 0 writes it
        yield p


def ensure_optimizer_state(engine) -> None:
    """Give every parameter of the optimizer an Adam state (zeros where no step was taken yet) and
    have DeepSpeed's ZeRO 1/2 link its per-parameter views to it: both are lazy otherwise."""
    opt = torch_optimizer(engine)
    flat = [p for group in opt.param_groups for p in group["params"]]
    # ZeRO-3 steps its flat fp32 partitions one sub-group at a time, outside param_groups.
    flat += ds.zero3_flat_groups(engine)
    for p in flat:
        if not opt.state[p]:
            opt.state[p].update(first_step_state(opt, p))
    ds.relink_optimizer_state(engine)


def _host_clone(key: tuple, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().cpu().reshape(-1).clone()


def local_fragments(engine, dims: ParallelDims,
                    copy: Callable[[tuple, torch.Tensor], torch.Tensor] = _host_clone) -> list[Fragment]:
    """This rank's fragments (empty for a replica whose state another rank writes). ``copy``
    takes each tensor to the host under a key of its own (``HostCopies.copy``: reused buffers,
    possibly still being filled, in the tensor's dtype; by default a new fp32 clone)."""
    module = engine.module
    ensure_optimizer_state(engine)
    out: list[Fragment] = []
    plain_opt = masters = None
    for p in _owned_parameters(module, dims):
        shape = ds.full_shape(p)
        name = spec(p).name
        piece = (name, spec(p).cuts)  # the buffers' key: tiles of one parameter share its name
        if ds.has_hp_mapping(p):  # ZeRO 1/2 and DeepSpeed's bf16 optimizer
            mapping = ds.hp_mapping(p)
            if mapping is None:
                continue
            start, _ = ds.hp_range(mapping)
            tensors = {"param": copy((*piece, "param"), mapping.get_hp_fragment())}
            for key in STATE_KEYS:
                tensors[key] = copy((*piece, key), mapping.get_hp_fragment(key))
        elif ds.is_zero3(p):
            from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

            start, numel = ds.zero3_range(p)
            if numel == 0 or dims.replica_rank != 0:  # HSDP: the other copies hold the same
                continue
            tensors = {"param": copy((*piece, "param"), safe_get_local_fp32_param(p)[:numel])}
            for key in STATE_KEYS:
                tensors[key] = copy((*piece, key), safe_get_local_optimizer_state(p, key)[:numel])
        else:  # no ZeRO: every data-parallel replica holds everything; the first one writes
            if dims.dp_rank != 0 or dims.ulysses_rank != 0:
                continue
            plain_opt = plain_opt or torch_optimizer(engine)
            masters = ds.master_weights(engine) if masters is None else masters
            master = masters.get(p, p)  # bf16/fp16: the optimizer steps (and keys) the fp32 copy
            state = plain_opt.state.get(master, {})
            start = 0
            tensors = {"param": copy((*piece, "param"), master)}
            for key in STATE_KEYS:
                value = state.get(key)
                tensors[key] = copy((*piece, key), value) if value is not None else torch.zeros(p.numel())
        out.append(Fragment(name, shape, spec(p).cuts, start, tensors))
    return out


class Assembler:
    """Full tensors by (plain-model name, key), assembled on demand from all ranks' fragments,
    or with ``complete=False`` from the fragments a rank needs (``needed_files``): what they do
    not cover is NaN, and the loader checks its own region (``load_fragments``).

    ``heads``: (n_heads, n_kv_heads) of the model; a checkpoint written before q|k|v and gate|up
    were fused then offers its separate projections under the fused names (``model/fused.py``),
    weights and optimizer moments alike."""

    def __init__(self, fragments: Iterable[Fragment], complete: bool = True,
                 heads: tuple[int, int] | None = None):
        self.complete = complete
        self.by_name: dict[str, list[Fragment]] = {}
        for f in fragments:
            f.check()
            self.by_name.setdefault(f.name, []).append(f)
        self.heads = heads
        self.merged = fusable(self.by_name) if heads is not None else {}
        self._parts = {p for parts in self.merged.values() for p in parts}
        both = sorted(name for name in self.merged if name in self.by_name)
        if both:
            raise ValueError(f"the checkpoint holds {both[0]} and also the separate projections it fuses "
                             f"({', '.join(self.merged[both[0]])}); one of them is left from another write")

    def missing_parts(self, name: str) -> str:
        """Why ``name`` (not in ``names``) is missing, in words: a fused projection whose
        checkpoint holds some of its separate parts names those it lacks."""
        parts = parts_of(name)
        if parts is not None and self.heads is not None:
            held = [p for p in parts if p in self.by_name]
            if held:
                lacking = [p for p in parts if p not in self.by_name]
                return f"{', '.join(lacking)} is not in the checkpoint (it holds {', '.join(held)})"
        return f"{name} is not in the checkpoint"

    def names(self) -> set[str]:
        return (set(self.by_name) - self._parts) | set(self.merged)

    def shape(self, name: str) -> tuple[int, ...]:
        """The whole shape of ``name`` its fragments record (bounded by what they hold), without
        assembling it."""
        if name in self.merged:
            shapes = [self.shape(p) for p in self.merged[name]]
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        frags = self.by_name[name]
        self._check_extent(name, frags)
        return whole_shape(frags[0].slice_shape, frags[0].cuts)

    def full(self, name: str, key: str) -> torch.Tensor:
        if name in self.merged:
            return fuse_parts(name, [self.full(p, key) for p in self.merged[name]], *self.heads)
        frags = self.by_name.get(name)
        if not frags:
            raise KeyError(f"the checkpoint has no parameter '{name}'")
        self._check_extent(name, frags)
        pieces: dict[tuple[Cut, ...], torch.Tensor] = {}
        for f in frags:
            flat = pieces.setdefault(f.cuts, torch.full((math.prod(f.slice_shape),), math.nan))
            t = f.tensors[key]
            flat[f.start:f.start + t.numel()] = t
        shapes = {f.cuts: f.slice_shape for f in frags}
        full = joined((cuts, flat.view(shapes[cuts])) for cuts, flat in pieces.items())
        if self.complete and torch.isnan(full).any():
            raise ValueError(not_covered(name, key))
        return full

    def check_values(self, name: str) -> None:
        """Before any weight is assembled: the fragments of ``name`` (a name they record) cover
        each of its pieces from end to end, and its weights are finite; ``ValueError`` naming
        it. (Counting elements alone lets a fragment shifted over its neighbour leave a gap.)"""
        frags = self.by_name[name]
        self._check_extent(name, frags)
        by_piece: dict[tuple[Cut, ...], list[Fragment]] = {}
        for f in frags:
            by_piece.setdefault(f.cuts, []).append(f)
        for group in by_piece.values():
            end = 0
            for f in sorted(group, key=lambda f: f.start):
                if f.start > end:
                    break
                end = max(end, f.start + f.numel)
            if end < math.prod(group[0].slice_shape):
                raise ValueError(not_covered(name))
        for f in frags:
            for chunk in f.tensors["param"].split(1 << 22):
                if not bool(torch.isfinite(chunk).all()):
                    raise ValueError(f"the checkpoint's '{name}' holds weights that are not finite "
                                     "(NaN or infinite): it was saved after its run diverged; use an "
                                     "earlier checkpoint")

    def _check_extent(self, name: str, frags: list[Fragment]) -> None:
        """Before anything is allocated for ``name``: its pieces and the whole are no larger than
        the elements its fragments hold (which their files' real sizes bound), so a recorded
        shape or cut count cannot make the loader allocate more than the checkpoint holds."""
        by_piece: dict[tuple[Cut, ...], list[Fragment]] = {}
        for f in frags:
            by_piece.setdefault(f.cuts, []).append(f)
        pieces = 0
        for cuts, group in by_piece.items():
            shapes = {f.slice_shape for f in group}
            if len(shapes) > 1:
                raise ValueError(f"the checkpoint's fragments of '{name}' disagree on the shape of "
                                 f"piece {list(cuts)}: {sorted(shapes)}")
            piece_numel = math.prod(group[0].slice_shape)
            if self.complete and piece_numel > sum(f.numel for f in group):
                raise ValueError(not_covered(name))
            pieces += piece_numel
        # (A partial set is bounded instead by the model's own shapes, which the loader
        # compares before assembling: shape_mismatches.)
        cuts, shape = next(iter(by_piece)), by_piece[next(iter(by_piece))][0].slice_shape
        if self.complete and math.prod(whole_shape(shape, cuts)) > pieces:
            raise ValueError(not_covered(name))


def not_covered(name: str, key: str | None = None) -> str:
    what = f"'{name}'" + (f" ({key})" if key else "")
    return f"the checkpoint's fragments of {what} do not cover it: files are missing"


def shape_mismatches(expected: Mapping[str, Sequence[int]], assembler: Assembler,
                     vocab: int) -> list[str]:
    """Each parameter of ``expected`` (name -> whole shape) that the checkpoint lacks or records
    with another shape, in words. A vocabulary parameter may have more rows (another layout's
    padding) but not fewer than ``vocab``, the tokenizer's ids. Compared before anything is
    assembled: the shapes come from the fragments' records."""
    problems = []
    names = assembler.names()
    for name, shape in expected.items():
        shape = tuple(shape)
        if name not in names:
            problems.append(assembler.missing_parts(name))
            continue
        have = assembler.shape(name)
        if name in VOCAB_PARAMETERS and len(have) == len(shape):
            fits = have[1:] == shape[1:] and have[0] >= vocab
        else:
            fits = have == shape
        if not fits:
            problems.append(f"{name} is {list(have)} in the checkpoint, {list(shape)} in this model")
    return problems


def _fit_vocabulary(where: ShardSpec, full: torch.Tensor) -> torch.Tensor:
    """A vocabulary parameter saved with another padding (another tensor-parallel size): drop or
    add padding rows, which are zero (the tokenizer's rows match: the manifest says so)."""
    rows = where.full_shape[0]
    if where.name not in VOCAB_PARAMETERS or full.shape[0] == rows:
        return full
    if full.shape[0] > rows:
        return full[:rows]
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def _local_slice(p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    where = spec(p)
    return where.local(_fit_vocabulary(where, full))


@torch.no_grad()
def load_fragments(engine, assembler: Assembler, step: int) -> None:
    """Set this rank's weights and optimizer state from ``assembler`` (any source layout)."""
    module = engine.module
    ensure_optimizer_state(engine)
    plain_opt = masters = None
    for p in module.parameters():
        values = {key: _local_slice(p, assembler.full(spec(p).name, key)).reshape(-1)
                  for key in ("param", *STATE_KEYS)}
        lo, hi = held_range(p)
        for key, value in values.items():  # (a partial assembly is NaN outside what was read)
            if torch.isnan(value[lo:hi]).any():
                raise ValueError(not_covered(spec(p).name, key))
        if ds.has_hp_mapping(p):
            mapping = ds.hp_mapping(p)
            p.data.copy_(values["param"].view_as(p).to(p.dtype))
            if mapping is None:
                continue
            start, numel = ds.hp_range(mapping)
            mapping.get_hp_fragment().data.copy_(values["param"][start:start + numel])
            for key in STATE_KEYS:
                mapping.get_hp_fragment(key).data.copy_(values[key][start:start + numel])
        elif ds.is_zero3(p):
            from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

            start, numel = ds.zero3_range(p)
            partition = ds.zero3_partition(p)
            padded = {}
            for key, value in values.items():
                padded[key] = torch.zeros(ds.zero3_padded_numel(p), dtype=torch.float32)
                padded[key][:numel] = value[start:start + numel]
                padded[key] = padded[key].to(partition.device)
            safe_set_local_fp32_param(p, padded["param"])
            partition.data.copy_(padded["param"].to(partition.dtype))
            for key in STATE_KEYS:
                safe_set_local_optimizer_state(p, padded[key], key)
        else:
            plain_opt = plain_opt or torch_optimizer(engine)
            masters = ds.master_weights(engine) if masters is None else masters
            p.data.copy_(values["param"].view_as(p).to(p.dtype))
            master = masters.get(p, p)  # bf16/fp16: the fp32 copy the optimizer steps
            if master is not p:
                master.data.copy_(values["param"].view_as(master))
            state = plain_opt.state.setdefault(master, {})
            for key in STATE_KEYS:
                state[key] = values[key].view_as(master).to(device=master.device, dtype=master.dtype).clone()
            # torch's AdamW keeps its step count as a tensor (float32, on the parameter's device
            # for the fused kernel).
            state["step"] = torch.tensor(float(step), dtype=torch.float32,
                                         device=master.device if plain_opt.defaults.get("fused") else "cpu")
