"""Checkpoints of a fully sharded model and its optimizer through :class:`lockstep.Checkpointer`.

:class:`ModelState` and :class:`OptimizerState` are what you pass to ``Checkpointer.save`` and
``restore`` in place of the model and the optimizer. Two forms:

* sharded (default): each rank writes its own piece (the real elements of its shards, padding
  cut, and of its optimizer state over them) through the Checkpointer's sharded seam
  (:mod:`lockstep.checkpoint.sharded`); nothing is gathered. Under hybrid sharding only the
  replica holding global rank 0 writes (the others hold the same values): one copy on disk.
* full (``full=True``): the unsharded state dict, gathered one unit at a time onto rank 0 (the
  Checkpointer's ``consolidate_state_dict`` seam, as for ZeRO): exactly what a plain model's
  ``state_dict()`` and a plain optimizer's ``state_dict()`` hold, so a plain model and optimizer
  restore it directly.

Either form restores at any world size and into an unsharded model (wrap it in
``ModelState``/``OptimizerState`` too): each parameter is a flat run of elements, rank ``r`` of
``N`` holding elements ``[r·c, (r+1)·c)`` with ``c = ceil(numel / N)``, so a rank of a new world
reads just the saved pieces its own run overlaps. Optimizer state tensors shaped like the
parameter (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's momentum) are resharded the same way;
the others (``step``, NAdam's ``mu_product``) are copied. A 0-dim parameter's state is all
0-dim, so which of its keys are per element is learnt from the optimizer's other parameters
(``_per_element_keys``). Optimizer state is matched to parameters by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.fsdp import collectives
from lockstep.fsdp.checkpoint_ranks import checkpoint_group_ranks, to_checkpoint_ranks
from lockstep.fsdp.unit import get_unit
from lockstep.wrappers import unwrap_model

__all__ = ["ModelState", "OptimizerState", "read_range"]


@dataclass(frozen=True)
class _Entry:
    """One parameter as this rank holds it: a shard of a unit, or the whole of a plain one."""

    param: torch.Tensor  # what the module holds (the shard, or the full parameter)
    shape: torch.Size  # the full shape
    numel: int
    chunk: int  # elements per rank (``numel`` for a parameter nobody shards)
    rank: int
    size: int
    group: dist.ProcessGroup | None
    owners: tuple[int, ...]  # the checkpoint rank holding each chunk
    me: int  # this rank in the checkpoint's group (lockstep.fsdp.checkpoint_ranks)

    @property
    def span(self) -> tuple[int, int]:
        """The elements of the full parameter this rank holds, without padding."""
        start = min(self.rank * self.chunk, self.numel)
        return start, min(start + self.chunk, self.numel)

    def writes(self) -> bool:
        """Whether this rank's piece carries the values: one copy each, by the replica of rank 0.

        Under hybrid sharding every replica holds the same shards; the one whose shard group
        holds global rank 0 writes them, the others write nothing (restoring reads ``owners``).
        """
        return 0 in self.owners and self.me == self.owners[self.rank]

    def meta(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "chunk": self.chunk, "owners": list(self.owners)}


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _layout(model: nn.Module, group: Any = None) -> dict[str, _Entry]:
    """Every parameter of ``model`` by name (ties once, under their first name).

    Ranks are those of the checkpoint's ``group`` (see :mod:`lockstep.fsdp.checkpoint_ranks`).
    """
    ranks = checkpoint_group_ranks(model, group)
    me = to_checkpoint_ranks(ranks, [_global_rank()], "this rank")[0]
    slots = {}
    for module in model.modules():
        unit = get_unit(module)
        if unit is not None:
            unit.flat.check_unchanged(type(module).__name__)
            for slot in unit.flat.slots:
                slots[id(slot.shard)] = (slot, unit)
    entries = {}
    for fqn, param in model.named_parameters():
        if id(param) in slots:
            slot, unit = slots[id(param)]
            owners = to_checkpoint_ranks(
                ranks, dist.get_process_group_ranks(unit.shard_group or dist.group.WORLD), fqn
            ) if dist.is_initialized() else (0,)
            entries[fqn] = _Entry(param, slot.shape, slot.numel, slot.chunk, unit.flat.rank,
                                  unit.flat.size, unit.shard_group, owners, me)
        else:
            entries[fqn] = _Entry(param, param.shape, param.numel(), param.numel(), 0, 1, None, (0,), me)
    return entries


def _writes_piece(model: nn.Module, group: Any) -> bool:
    """Whether this rank holds values no other rank writes (rank 0 also writes the buffers)."""
    return _checkpoint_rank(model, group) == 0 or any(e.writes() for e in _layout(model, group).values())


def _checkpoint_rank(model: nn.Module, group: Any) -> int:
    """This rank in the checkpoint's group (its rank 0 writes the buffers and the full form)."""
    return checkpoint_group_ranks(model, group).index(_global_rank())


def read_range(pieces: Sequence[Any], start: int, end: int, chunk: int, owners: Sequence[int],
               values: Any) -> torch.Tensor:
    """Elements ``[start, end)`` of a flat parameter saved in runs of ``chunk`` per rank.

    ``values(piece)`` is the saved run (padding cut) in ``pieces[owners[q]]`` for chunk ``q``;
    only the pieces the range overlaps are read.
    """
    if end <= start:
        return torch.empty(0)
    parts = []
    for q in range(start // chunk, (end - 1) // chunk + 1):
        run = values(pieces[owners[q]])
        parts.append(run[max(start, q * chunk) - q * chunk : min(end, (q + 1) * chunk) - q * chunk])
    return torch.cat(parts)


def _fill(entry: _Entry, value: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's run ``value`` laid out like ``entry.param`` (zero padding), in ``like``'s dtype."""
    target = like if like is not None else entry.param
    out = torch.zeros(entry.param.numel(), dtype=target.dtype, device=target.device)
    out[: value.numel()] = value.reshape(-1)
    return out.view(entry.param.shape)


def _run(entry: _Entry, tensor: torch.Tensor) -> torch.Tensor:
    """The real elements of a tensor laid out like ``entry.param``, copied to the CPU."""
    start, end = entry.span
    return tensor.detach().reshape(-1)[: end - start].to("cpu", copy=True)


def _gather(entry: _Entry, tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a tensor laid out like ``entry.param`` (a collective of its unit)."""
    if entry.size == 1:
        return tensor.detach().reshape(entry.shape).to("cpu", copy=True)
    out = tensor.new_empty(entry.size * entry.chunk)
    collectives.all_gather_into_tensor(out, tensor.detach().reshape(-1).contiguous(), entry.group).wait()
    return out[: entry.numel].view(entry.shape).to("cpu", copy=True)


def _check_names(what: str, expected: Sequence[str], found: Sequence[str], source: str) -> None:
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source}: {what} does not fit this model (missing: {missing[:10]}, unexpected: "
            f"{unexpected[:10]}); build the same architecture that wrote it"
        )


def _check_shape(fqn: str, saved: Sequence[int], entry: _Entry) -> None:
    if list(saved) != list(entry.shape):
        raise ValueError(f"parameter {fqn!r} was saved with shape {tuple(saved)}, the model has {tuple(entry.shape)}")


def _refuse_dtensors(state: Mapping[str, Any], where: str) -> None:
    """torch's FSDP2 state dict holds DTensors (sharded): name what to load instead."""
    found = [key for key, value in state.items() if type(value).__name__ == "DTensor"]
    if found:
        raise ValueError(
            f"{where}: {found[:3]} {'are' if len(found) > 1 else 'is a'} DTensor"
            f"{'s' if len(found) > 1 else ''} (the sharded state dict of torch's own "
            "fully_shard); give the full one instead: torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
        )


class ModelState:
    """A fully sharded (or plain) model as the Checkpointer saves and restores it.

    Args:
        model: the root given to ``fully_shard``, or an unsharded model to restore into.
        full: save the consolidated state dict on rank 0 instead of one piece per rank.
        process_group: the Checkpointer's ``process_group``, whose ranks name the files
            (``None``: the group ``model`` is sharded over if it has no replicas, else the
            default group).

    Example::

        ckpt.save(step, model=ModelState(model), optimizer=OptimizerState(model, opt))
        ckpt.restore(model=ModelState(model), optimizer=OptimizerState(model, opt))
    """

    def __init__(self, model: nn.Module, *, full: bool = False, process_group: Any = None) -> None:
        # DDP's (or torch.compile's) model is the same model: its names without the prefix
        self.model, self.full, self.process_group = unwrap_model(model), full, process_group
        self.save_sharded = not full  # the Checkpointer's switch (lockstep.checkpoint.sharded)
        self._consolidated: dict[str, torch.Tensor] | None = None

    def _buffers(self) -> dict[str, torch.Tensor]:
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        return {k: v for k, v in self.model.state_dict().items() if k not in params}

    # -- sharded -------------------------------------------------------------------------------

    def writes_piece(self) -> bool:
        """Whether this rank writes a piece: false on hybrid replicas without global rank 0."""
        return _writes_piece(self.model, self.process_group)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's piece: its run of every parameter it owns, and the buffers on rank 0."""
        params = {}
        for fqn, entry in _layout(self.model, self.process_group).items():
            params[fqn] = {**entry.meta(), **({"values": _run(entry, entry.param)} if entry.writes() else {})}
        buffers = {k: v.detach().to("cpu", copy=True) for k, v in self._buffers().items()} if _checkpoint_rank(self.model, self.process_group) == 0 else {}
        return {"params": params, "buffers": buffers}

    @torch.no_grad()
    def load_sharded_state_dict(self, pieces: Sequence[Any]) -> None:
        """Load the pieces saved at any world size: each rank reads the runs it overlaps."""
        index = pieces[0]["params"]
        layout = _layout(self.model, self.process_group)
        _check_names("the saved model", list(layout), list(index), getattr(pieces, "source", "checkpoint"))
        for fqn, entry in layout.items():
            saved = index[fqn]
            _check_shape(fqn, saved["shape"], entry)
            run = read_range(pieces, *entry.span, saved["chunk"], saved["owners"],
                             lambda piece, fqn=fqn: piece["params"][fqn]["values"])
            entry.param.copy_(_fill(entry, run))
        for name, value in self._buffers().items():
            value.copy_(pieces[0]["buffers"][name])

    # -- full ----------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the unsharded state dict onto rank ``to`` (every rank must call it)."""
        if not self.full:
            return
        keep = _checkpoint_rank(self.model, self.process_group) == to
        full = {}
        for entry in _layout(self.model, self.process_group).values():
            value = _gather(entry, entry.param)  # a collective on every rank; only ``to`` keeps it
            if keep:
                full[id(entry.param)] = value
        self._consolidated = None
        if keep:
            current = self.model.state_dict(keep_vars=True)
            self._consolidated = {k: full.get(id(v), v).detach().clone() for k, v in current.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded state dict consolidated last (as a plain model's ``state_dict()``)."""
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {_global_rank()} holds no consolidated model state: call "
                "consolidate_state_dict() on every rank first (Checkpointer.save does)"
            )
        return self._consolidated

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (saved at any world size, or by a plain model)."""
        _refuse_dtensors(state, "load_state_dict")
        current = self.model.state_dict(keep_vars=True)
        _check_names("the state dict", list(current), list(state), "load_state_dict")
        entries = {id(e.param): e for e in _layout(self.model, self.process_group).values()}
        for key, value in current.items():
            entry = entries.get(id(value))
            if entry is None:
                value.copy_(state[key])
                continue
            _check_shape(key, state[key].shape, entry)
            start, end = entry.span
            value.copy_(_fill(entry, state[key].reshape(-1)[start:end]))


def _per_element_keys(
    state: Mapping[Any, Mapping[str, Any]], shape: Callable[[int], Sequence[int]]
) -> dict[str, bool]:
    """Which keys of an optimizer's ``state`` (by position) hold one number per element.

    ``shape(position)`` is the shape the values are laid out in (full, or this rank's shard).
    Only parameters of one dimension or more tell: there a per-element value (``exp_avg``) has
    the parameter's shape and a scalar (``step``, NAdam's ``mu_product``, ASGD's ``eta``) does
    not. A 0-dim parameter's values are all 0-dim, so its keys are classified by the others'.
    """
    kinds: dict[str, bool] = {}
    for position, per_param in state.items():
        size = tuple(shape(int(position)))
        for key, value in per_param.items():
            if size and isinstance(value, torch.Tensor):
                kinds[key] = kinds.get(key, False) or tuple(value.shape) == size
    return kinds


def _per_element(value: Any, shape: Sequence[int], key: str, kinds: Mapping[str, bool]) -> bool:
    """Whether an optimizer state value holds one number per element of a parameter of ``shape``.

    ``kinds`` (from :func:`_per_element_keys`) decides for a 0-dim parameter; a key no other
    parameter holds falls back to its name: ``step`` is a counter, the rest per element.
    """
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        return False
    return len(shape) > 0 or kinds.get(key, key != "step")


class OptimizerState:
    """The optimizer over a fully sharded (or plain) model, as the Checkpointer saves and restores it.

    Args:
        model: the model whose ``parameters()`` the optimizer was built over.
        optimizer: a plain torch optimizer (AdamW, SGD...).
        full: save a plain optimizer's state dict (full-size tensors) on rank 0.
        process_group: the Checkpointer's ``process_group`` (as for :class:`ModelState`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, full: bool = False,
                 process_group: Any = None) -> None:
        self.model, self.optimizer = unwrap_model(model), optimizer
        self.full, self.process_group = full, process_group
        self.save_sharded = not full
        self._consolidated: dict[str, Any] | None = None

    def _positions(self) -> tuple[list[str], dict[str, _Entry]]:
        layout = _layout(self.model, self.process_group)
        names = {id(e.param): fqn for fqn, e in layout.items()}
        fqns = []
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in names:
                    raise ValueError("the optimizer holds a parameter that is not in the model; pass the model it was built over")
                fqns.append(names[id(param)])
        return fqns, layout

    def _check_groups(self, saved: Sequence[Mapping[str, Any]], source: str) -> None:
        ours = [len(g["params"]) for g in self.optimizer.param_groups]
        theirs = [len(g["params"]) for g in saved]
        if ours != theirs:
            raise ValueError(f"{source}: saved parameter groups of sizes {theirs}, this optimizer has {ours}")

    # -- sharded -------------------------------------------------------------------------------

    def writes_piece(self) -> bool:
        """Whether this rank writes a piece: false on hybrid replicas without global rank 0."""
        return _writes_piece(self.model, self.process_group)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's piece: its run of each per-element state tensor, the rest as it is."""
        fqns, layout = self._positions()
        saved = self.optimizer.state_dict()
        kinds = _per_element_keys(saved["state"], lambda p: layout[fqns[p]].param.shape)
        state = {}
        for position, per_param in saved["state"].items():
            entry = layout[fqns[position]]
            kept = {}
            for key, value in per_param.items():
                if _per_element(value, entry.param.shape, key, kinds):
                    kept[key] = {"values": _run(entry, value)} if entry.writes() else {}
                else:
                    kept[key] = {"value": value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value}
            state[fqns[position]] = {**entry.meta(), "state": kept}
        return {"param_groups": saved["param_groups"], "state": state}

    def load_sharded_state_dict(self, pieces: Sequence[Any]) -> None:
        """Load the pieces saved at any world size (state matched to parameters by name)."""
        first = pieces[0]
        self._check_groups(first["param_groups"], getattr(pieces, "source", "checkpoint"))
        fqns, layout = self._positions()
        state = {}
        for position, fqn in enumerate(fqns):
            saved = first["state"].get(fqn)
            if saved is None:
                continue
            entry = layout[fqn]
            _check_shape(fqn, saved["shape"], entry)
            per_param = {}
            for key, item in saved["state"].items():
                if "value" in item:
                    per_param[key] = item["value"]
                    continue
                run = read_range(pieces, *entry.span, saved["chunk"], saved["owners"],
                                 lambda piece, f=fqn, k=key: piece["state"][f]["state"][k]["values"])
                per_param[key] = _fill(entry, run, like=run if run.numel() else entry.param)
            state[position] = per_param
        self.optimizer.load_state_dict({"state": state, "param_groups": first["param_groups"]})

    # -- full ----------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather a plain optimizer's state dict (full-size tensors) onto rank ``to``."""
        if not self.full:
            return
        fqns, layout = self._positions()
        saved = self.optimizer.state_dict()
        kinds = _per_element_keys(saved["state"], lambda p: layout[fqns[p]].param.shape)
        keep = _checkpoint_rank(self.model, self.process_group) == to
        state: dict[int, dict[str, Any]] = {}
        for position, per_param in saved["state"].items():
            entry = layout[fqns[position]]
            values = {}
            for key, value in sorted(per_param.items()):  # the same collectives on every rank
                if _per_element(value, entry.param.shape, key, kinds):
                    value = _gather(entry, value)
                elif isinstance(value, torch.Tensor):
                    value = value.detach().to("cpu", copy=True)
                if keep:
                    values[key] = value
            if keep:  # in the optimizer's own key order, as a plain state_dict() lists them
                state[position] = {key: values[key] for key in per_param}
        self._consolidated = {"state": state, "param_groups": saved["param_groups"]} if keep else None

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer state dict consolidated last."""
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {_global_rank()} holds no consolidated optimizer state: call "
                "consolidate_state_dict() on every rank first (Checkpointer.save does)"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a plain optimizer's state dict (saved at any world size, or unsharded)."""
        self._check_groups(state_dict["param_groups"], "load_state_dict")
        fqns, layout = self._positions()
        kinds = _per_element_keys(state_dict["state"], lambda p: layout[fqns[p]].shape)
        state = {}
        for position, per_param in state_dict["state"].items():
            entry = layout[fqns[int(position)]]
            start, end = entry.span
            state[int(position)] = {
                key: _fill(entry, value.reshape(-1)[start:end], like=value)
                if _per_element(value, entry.shape, key, kinds) else value
                for key, value in per_param.items()
            }
        self.optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
