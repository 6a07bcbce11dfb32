"""Survivors that keep training: a failed rank leaves the world, a replacement joins later.

Under ``lockstep run --survivors`` (one machine or several), a worker that dies does not stop the others:
the launcher gives its slot to a replacement and marks the dead process in the store. The
survivors' next collective fails at once (the peer's sockets close); :meth:`Survivors.step`
catches that, holds a roll call through the store, and the members still alive form the next
*generation*: a new default process group made from the store, the DDP model moved onto it
(:meth:`~lockstep.DistributedDataParallel.use_process_group`), every member brought to the
state of the member that completed the most steps, and the failed step run again in the
smaller world (unless this member's ``optimizer.step()`` had run: then the step counts as done,
see :meth:`Survivors.step`). The replacement waits at its first :meth:`~Survivors.step` until the first
member admits it at a step boundary (every ``admit_every`` steps while the world is short) and
receives the state over the process group; the world is whole again.

Without ``--survivors`` (``lockstep run``, torchrun, srun, plain ``python``) the same script
runs as usual: :class:`Survivors` creates the default group with
:func:`lockstep.init_distributed`, and a failure propagates as it always did.

What changes during degraded steps: each step averages over fewer ranks, so the global batch
is smaller (``world x per-rank batch``). :attr:`Survivors.world_size` says how many ranks the
step has; scale the learning rate with it where the recipe ties the two (linear scaling), or
keep the global batch by giving each rank more samples. :meth:`Survivors.batches` re-shards
what is left of the epoch over the new world, so every sample is still read once per epoch.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lockstep.checkpoint.meeting import add_absence_probe
from lockstep.diagnose.progress import tracker
from lockstep.distributed import (
    DEFAULT_TIMEOUT,
    init_distributed,
    leave_safely_at_exit,
    resolve_device,
    shutdown_distributed,
)
from lockstep.env import SURVIVORS_ENV, default_backend
from lockstep.fsdp.registry import is_sharded
from lockstep.resilience.heartbeat import Heartbeat, beat_interval, beat_key, heartbeat_timeout
from lockstep.resilience.losses import LossWatch
from lockstep.resilience.roster import (
    Member,
    Proposal,
    dead_key,
    job_store,
    propose,
    spare_key,
    wait_until,
)
from lockstep.resilience.sockets import GroupSockets
from lockstep.resilience.transfer import broadcast_state

__all__ = ["JOIN_ENV", "SPARE_ENV", "SURVIVORS_ENV", "Survivors", "is_peer_failure"]

JOIN_ENV = "LOCKSTEP_SURVIVOR_JOIN"  # "1": this process replaces a failed one
SPARE_ENV = "LOCKSTEP_SURVIVOR_SPARE"  # "1": a warm spare, waiting for the rank it replaces


# What a backend raises when a peer died or cut the connection (gloo, NCCL, the store), and
# nothing else: a program's own error that merely says "timed out" (a DataLoader's) must stay
# that process's failure, not stop its peers too.
_PEER_FAILURE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|reset by peer|broken pipe|"
    r"gloo/transport|processgroupgloo|processgroupnccl|"
    r"timed out waiting \d+ ?ms for (send|recv)|socket timeout|"
    r"nccl ?(communicator|error|remote|system)|communicator was aborted|"
    r"process ?group (was |has been )?(aborted|shut ?down)", re.IGNORECASE)


def is_peer_failure(exc: BaseException) -> bool:
    """Did ``exc`` (or an exception it was raised from) come from a failed collective?"""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError) or (
                isinstance(current, RuntimeError) and _PEER_FAILURE.search(str(current))):
            return True
        current = current.__cause__ or current.__context__
    return False


def _refuse_fixed_world(model: Any, optimizer: Any) -> None:
    """Refuse what keeps the process group, rank and world it was built with."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "track(model=...): torch's DistributedDataParallel keeps the process group it "
            "was built with and cannot follow a new world; wrap the model in "
            "lockstep.DistributedDataParallel instead (same arguments)"
        )
    if isinstance(model, torch.nn.Module) and is_sharded(model):
        raise TypeError(
            "track(model=...): a lockstep.fully_shard model keeps the process group, rank and "
            "world size it was sharded over (each rank holds 1/N of every parameter), so it "
            "cannot follow a new world; lockstep.Survivors supports lockstep."
            "DistributedDataParallel with a plain torch optimizer"
        )
    zero = sys.modules.get("lockstep.zero.optimizer")  # not imported: not one of its optimizers
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        raise TypeError(
            "track(optimizer=...): a lockstep.ZeroRedundancyOptimizer keeps the process group "
            "and rank it was built with (each rank owns a shard of the state), so it cannot "
            "follow a new world; lockstep.Survivors supports lockstep.DistributedDataParallel "
            "with a plain torch optimizer (e.g. torch.optim.AdamW)"
        )


class Survivors:
    """Keep a data-parallel loop running through the loss of ranks (see the module docstring).

    Create it instead of calling :func:`lockstep.init_distributed`, then build the model and
    optimizer, :meth:`track` them, and run each step inside :meth:`step`::

        team = lockstep.Survivors()
        model = lockstep.DistributedDataParallel(Net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        team.track(model, optimizer)
        while team.completed < 1000:
            with team.step():   # a peer's failure: the step runs again (or counts, if
                                # optimizer.step() had run) in the smaller world
                x = batch_for(team.completed, team.rank, team.world_size)
                optimizer.zero_grad()
                model(x).sum().backward()
                optimizer.step()

    Attributes: ``completed`` (steps completed; a replacement takes its peers' count),
    ``slot`` (this process's rank as launched, kept across worlds), ``slots`` (the world as
    launched), ``rank``/``world_size``/``members`` (the current world), ``generation`` and
    ``history`` (``(first step, slots)`` per world so far: the schedule a replay needs).

    Args:
        admit_every: while the world is short, look for replacements every this many steps.
        detect_timeout: seconds a roll call waits for a member that neither answers nor is
            marked dead by the launcher, before counting it gone.
        join_timeout: seconds a replacement waits to be admitted.
        backend: the process groups' backend (by default gloo on CPU, NCCL on CUDA).
        timeout: the process groups' collective timeout.
    """

    def __init__(self, *, admit_every: int = 10, detect_timeout: float = 60.0,
                 join_timeout: float = 600.0, backend: str | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if admit_every < 1:
            raise ValueError(f"admit_every={admit_every}: must be 1 or more")
        if detect_timeout <= 0 or join_timeout <= 0:
            raise ValueError("detect_timeout and join_timeout must be positive seconds")
        self.admit_every = admit_every
        self.detect_timeout = detect_timeout
        self.join_timeout = join_timeout
        self.timeout = timeout
        self.completed = 0
        self.generation = 0
        self.history: list[tuple[int, tuple[int, ...]]] = []  # (first step, slots) per generation
        self._sockets = GroupSockets()
        self._model: Any = None
        self._optimizer: Any = None
        self._extra: dict[str, Any] = {}
        self._position = {"epoch": 0, "consumed": 0}  # batches(): where the data stands
        self._next_consumed: int | None = None
        self._lock = threading.Lock()  # held while the members change (see _watch)
        self._watch: LossWatch | None = None
        self._stepped = False  # the tracked optimizer stepped during the current step()
        self._step_hook: Any = None
        self._unprobe: Any = None
        self._members: tuple[Member, ...] = ()  # the current world, in rank order
        self.active = os.environ.get(SURVIVORS_ENV) == "1"
        info = init_distributed(backend=backend, timeout=timeout) if not self.active else None
        if info is not None:
            self.device, self.backend = info.device, str(info.backend)
            self.slot, self.slots = dist.get_rank(), dist.get_world_size()
            self._members = tuple(Member(s, -1) for s in range(self.slots))
            self.history.append((0, tuple(range(self.slots))))
            return
        self.pid = os.getpid()
        leave_safely_at_exit()  # no init_distributed() here: the groups are made below
        self._store = self._connect()
        if os.environ.get(JOIN_ENV) != "1":  # named before the first beat: a member watched
            # by the launcher is a member its peers know, so its death ends their wait
            self._store.set(f"g0/pid/{os.environ['RANK']}", str(self.pid))
        self._beat = self._start_heartbeat()  # before a spare's wait: a frozen spare is seen
        # A Checkpointer's meeting learns of a member's death from the launcher's mark, as the
        # roll call does (it waited for its own timeout, 10 minutes, before 2026-11-29).
        self._unprobe = add_absence_probe(self._dead_members)
        if os.environ.get(SPARE_ENV) == "1":
            self._wait_for_a_rank()
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # machines can vanish silently
            self._watch = LossWatch(self._connect, self._member_lost, self._sockets.shutdown,
                                    self._lock)
            # Ended before the interpreter finalizes, even without finish(): a daemon thread
            # inside a store call then could take the process down at exit.
            atexit.register(self._watch.stop)
        self.slot, self.slots = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.device = resolve_device(os.environ.get("LOCKSTEP_DEVICE"),
                                     int(os.environ.get("LOCAL_RANK", "0")))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.backend = backend or default_backend(self.device)
        self._joining = os.environ.get(JOIN_ENV) == "1"
        if self._joining:  # a world of one until admitted: the model can be built meanwhile
            self._members = (Member(self.slot, self.pid),)
            self._init_group(f"solo/{self.slot}/{self.pid}/", 0, 1)
            return
        self._form_first_world()

    def _form_first_world(self) -> None:
        """Generation 0, every slot; a member lost before it formed (killed, or frozen and
        killed by the launcher) leaves the others to form generation 1 without it."""
        def named() -> tuple[Member, ...] | None:
            keys = [f"g0/pid/{s}" for s in range(self.slots)]
            if not self._store.check(keys):
                return None
            return tuple(Member(s, int(self._store.get(k))) for s, k in enumerate(keys))

        self._members = wait_until(named, self.timeout.total_seconds(), "the first members", 0.01)
        try:
            self._init_group("g0/pg/", self.slot, self.slots, self._members)
        except dist.DistNetworkError as exc:  # a member was marked dead meanwhile
            self._recover(exc)
            return
        self.history.append((0, tuple(range(self.slots))))

    def _connect(self) -> Any:
        """A new client of the launcher's store, inside the survivors' keys."""
        master = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               is_master=False, timeout=timedelta(seconds=self.join_timeout))
        return job_store(master)

    def _start_heartbeat(self) -> Heartbeat | None:
        """Beat until the process exits (after ``finish()`` too: the script may go on with other
        work), so that the launcher tells it from a frozen one
        (:mod:`lockstep.resilience.heartbeat`)."""
        timeout = heartbeat_timeout()
        if timeout is None:
            return None
        key = beat_key(int(os.environ.get("GROUP_RANK", "0")), self.pid)
        self._store.add(key, 1)  # the first beat now: the launcher watches from here on
        beat = Heartbeat(self._connect, key, beat_interval(timeout))
        atexit.register(beat.stop)  # as the loss watch: no thread inside a store call at exit
        return beat

    def _dead_members(self, ranks: list[int]) -> dict[int, str]:
        """Which of ``ranks`` (of the current world) a launcher has marked dead, and how."""
        dead = {}
        for rank in ranks:
            if 0 <= rank < len(self._members) and self._members[rank].slot != self.slot:
                member = self._members[rank]
                key = dead_key(member.slot, member.pid)
                if self._store.check([key]):
                    dead[rank] = (f"(slot {member.slot}, pid {member.pid}) died: a launcher "
                                  f"marked it dead ({self._store.get(key).decode()})")
        return dead

    def _member_lost(self, store: Any) -> bool:
        """Has a launcher marked a member of the current world (not this one) dead?"""
        return any(store.check([dead_key(m.slot, m.pid)]) for m in self._members
                   if m.pid != self.pid or m.slot != self.slot)

    def _wait_for_a_rank(self) -> None:
        """A warm spare: finish the imports a worker needs, then wait for the launcher to name
        the rank this process replaces (``RANK``/``LOCAL_RANK`` are set then), or for the end."""
        import lockstep.ddp.wrapper  # noqa: F401 - DDP's imports (torch._dynamo...) done now

        key = spare_key(int(os.environ.get("GROUP_RANK", "0")), self.pid)

        def named() -> str | None:
            if self._store.check([key]):
                return self._store.get(key).decode()
            return "done" if self._store.check(["done"]) else None

        named_as = wait_until(named, float("inf"), "a rank to replace", poll=0.02)
        if named_as == "done":
            raise SystemExit(0)  # the job finished without needing this spare
        rank, local_rank, *restarts = named_as.split(",")
        os.environ.update(RANK=rank, LOCAL_RANK=local_rank, ROLE_RANK=rank)
        if restarts:  # the launcher's replacements so far, this one included
            os.environ["TORCHELASTIC_RESTART_COUNT"] = restarts[0]

    # ---- what the loop sees -------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the current world."""
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        """How many ranks the current world has (fewer than launched while degraded)."""
        return dist.get_world_size()

    @property
    def members(self) -> list[int]:
        """The slots (ranks as launched) in the current world, in rank order."""
        return [m.slot for m in self._members]

    def track(self, model: Any, optimizer: Any = None, **state: Any) -> None:
        """What follows the world: ``model`` (lockstep DDP) moves to each new process group;
        ``model``, ``optimizer`` and every ``state`` object (anything with ``state_dict`` and
        ``load_state_dict``: an LR scheduler, a sampler) are what a member that fell behind or
        a replacement receives.

        The optimizer's steps are watched (a step post-hook): a peer's failure after
        ``optimizer.step()`` counts the step as done rather than running it again.

        Raises:
            TypeError: torch's DDP, a ``lockstep.fully_shard`` model or a
                ``lockstep.ZeroRedundancyOptimizer`` (they keep the world they were built in),
                or a ``state`` object without ``state_dict``/``load_state_dict``.
        """
        _refuse_fixed_world(model, optimizer)
        for name, obj in state.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"track({name}=...): {type(obj).__name__} has no "
                                "state_dict/load_state_dict to send to a replacement")
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        if optimizer is not None and hasattr(optimizer, "register_step_post_hook"):
            self._step_hook = optimizer.register_step_post_hook(self._note_optimizer_step)
        self._model, self._optimizer, self._extra = model, optimizer, state

    def _note_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._stepped = True

    @contextlib.contextmanager
    def step(self) -> Iterator[Survivors]:
        """One training step. On a peer's failure the exception is caught and the world
        re-forms; a step whose ``optimizer.step()`` (the tracked optimizer's) had run on this
        member counts as done, and the rest of its body is skipped; a step that had not got
        that far is not counted, and the loop runs it again. Any other error propagates."""
        if self.active and self._joining:
            self._join()
        self._stepped = False
        try:
            yield self
        except Exception as exc:
            if not self.active or not is_peer_failure(exc):
                raise  # this program's own error: the process fails, its peers go on
            if self._stepped:
                # The update is applied (its gradients were every member's): running the step
                # again would apply a second one. Counted before the roll call, this member
                # reports the step done and is the state source for any member behind.
                self._count_step()
            self._next_consumed = None
            self._recover(exc)
            return
        self._count_step()
        if self.active and len(self._members) < self.slots and self.completed % self.admit_every == 0:
            try:
                self._admit()
            except Exception as exc:  # a replacement (or member) lost during its admission
                if not is_peer_failure(exc):
                    raise
                self._recover(exc)

    def _count_step(self) -> None:
        """The step completed: count it and the samples it read."""
        self.completed += 1
        if self._next_consumed is not None:
            self._position["consumed"], self._next_consumed = self._next_consumed, None

    def finish(self) -> None:
        """Say the job is done (a replacement still waiting to join then exits) and leave."""
        if self._unprobe is not None:
            self._unprobe()
            self._unprobe = None
        if self._watch is not None:
            self._watch.stop()
            atexit.unregister(self._watch.stop)
        if self.active:
            self._store.set("done", "1")
        shutdown_distributed()  # destroys the group, then lets gloo's threads settle

    def batches(self, loader: Iterable, epochs: int) -> Iterator[Any]:
        """The batches of ``epochs`` passes over ``loader`` (a DataLoader over a
        :class:`lockstep.DistributedSampler`), re-sharded over each new world.

        Only completed steps consume samples: after a failure the failed step's samples are
        read again, spread over the ranks left. The position in the epoch travels with the
        state, so a replacement reads on from where its peers are.
        """
        sampler = getattr(loader, "sampler", None)
        batch = getattr(loader, "batch_size", None)
        if sampler is None or not hasattr(sampler, "load_state_dict") or not batch:
            raise TypeError("batches() needs a DataLoader with a batch_size and a "
                            "lockstep.DistributedSampler")
        if self.active and self._joining:
            self._join()  # before the first batch: it is drawn in the world joined
        total = len(sampler.dataset)
        while self._position["epoch"] < epochs:
            epoch, consumed = self._position["epoch"], self._position["consumed"]
            sampler.set_epoch(epoch)
            sampler.num_replicas, sampler.rank = self.world_size, self.rank
            sampler.load_state_dict({"epoch": epoch, "consumed": consumed})
            generation = self.generation
            for item in loader:
                # What this step consumes if it completes (counted by step(), before any
                # admission hands the position to a replacement).
                self._next_consumed = min(self._position["consumed"] + batch * self.world_size,
                                          total)
                yield item
                self._next_consumed = None
                if self.generation != generation:
                    break  # the world changed: re-shard what is left of the epoch
            else:
                self._position = {"epoch": epoch + 1, "consumed": 0}

    # ---- generations -------------------------------------------------------------------
    def _init_group(self, prefix: str, rank: int, world: int,
                    members: tuple[Member, ...] = ()) -> None:
        store = dist.PrefixStore(prefix, self._store)
        if members:
            self._await_members(store, rank, members)
        self._sockets.before()
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                timeout=self.timeout)
        self._sockets.after()
        found = tracker()
        if found is not None:
            found.new_world()  # collective counts start again in the new world, on every member

    def _await_members(self, store: Any, rank: int, members: tuple[Member, ...]) -> None:
        """Meet the new world's members before making its group, watching the launcher's marks
        of the dead: a member lost meanwhile is a peer's failure now (the group's own
        rendezvous would wait for it until ``timeout``, ten minutes by default).

        Raises:
            DistNetworkError: a member was marked dead (a failure of a peer: the caller's
                roll call follows).
        """
        store.set(f"lockstep-arrived/{rank}", str(self.pid))
        arrivals = [f"lockstep-arrived/{r}" for r in range(len(members))]

        def ready() -> Member | bool | None:
            if store.check(arrivals):
                return True
            return next((m for m in members if self._store.check([dead_key(m.slot, m.pid)])), None)

        found = wait_until(ready, self.timeout.total_seconds(), "the new world's members", 0.01)
        if isinstance(found, Member):
            raise dist.DistNetworkError(
                f"lockstep.Survivors: rank {found.slot} (pid {found.pid}) died while the world of "
                f"{len(members)} formed (a launcher marked it dead)")

    def _leave_group(self) -> None:
        self._sockets.shutdown()  # peers blocked on this rank fail now (see .sockets)
        if not dist.is_initialized():
            return
        abort = getattr(dist.group.WORLD, "abort", None)  # torch >= 2.6: close the sockets now
        if abort is not None:
            with contextlib.suppress(Exception):
                abort()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"step": self.completed, "position": dict(self._position),
                                 "history": [list(entry) for entry in self.history]}
        if self._model is not None:
            state["model"] = self._model.state_dict()
        if self._optimizer is not None:
            state["optimizer"] = self._optimizer.state_dict()
        state["extra"] = {name: obj.state_dict() for name, obj in self._extra.items()}
        return state

    def _load(self, state: dict[str, Any]) -> None:
        self._position = dict(state["position"])
        # the worlds so far (a replacement's own list starts empty): what a replay needs
        self.history = [(int(step), tuple(slots)) for step, slots in state["history"]]
        if self._model is not None:
            self._model.load_state_dict(state["model"])
        if self._optimizer is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        for name, obj in self._extra.items():
            obj.load_state_dict(state["extra"][name])

    def _require_tracked(self) -> None:
        """A world about to change needs the model to move and to send (never retried)."""
        if self._model is None:
            raise RuntimeError(
                f"lockstep.Survivors: the world changes after step {self.completed} (a rank "
                "failed or a replacement joins), but nothing was tracked: call "
                "team.track(model, optimizer, ...) once they are built, so that the model "
                "follows the new process group and a replacement receives their state"
            )

    def _enter(self, proposal: Proposal) -> None:
        """Make ``proposal`` the world: its process group, the model on it, one state."""
        self._leave_group()
        # The generation is this one from now on, even if making its group fails (a member
        # lost meanwhile): the next roll call is then this generation's.
        with self._lock:  # the loss watch never judges a world half changed
            self.generation, self._members = proposal.generation, proposal.members
        self._init_group(f"g{proposal.generation}/pg/", proposal.rank_of(self.slot),
                         len(proposal.members), proposal.members)
        if self._model is not None and hasattr(self._model, "use_process_group"):
            self._model.use_process_group(None)
        if any(m.step != proposal.step for m in proposal.members):
            state = broadcast_state(self._state(), proposal.rank_of(proposal.source), self.device)
            # Members at the source's step hold its state already (as when nobody lags, and no
            # state travels at all): loading it again would only write every parameter in
            # place, which fails an asynchronous checkpoint still being copied (it cannot tell
            # the same values from new ones).
            if self._own_step(proposal) != proposal.step:
                self._load(state)
        self.completed = proposal.step
        self.history.append((proposal.step, tuple(proposal.slots)))

    def _own_step(self, proposal: Proposal) -> int:
        """The step this member brought into ``proposal`` (-1: a replacement)."""
        return next(m.step for m in proposal.members if m.slot == self.slot)

    def _recover(self, exc: Exception) -> None:
        """After an error in a step: the roll call, then the next generation (or ``exc``)."""
        if self.history:  # before the first world formed, there is no state to send yet
            self._require_tracked()
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none=True)
        while True:
            generation = self.generation
            self._leave_group()  # peers still blocked on this process fail at once
            store = self._store
            store.set(f"g{generation}/failed", "1")
            store.set(f"g{generation}/alive/{self.slot}", f"{self.pid},{self.completed}")

            if not store.check([f"g{generation}/next"]):
                try:
                    found = wait_until(functools.partial(self._roll_call, generation, False),
                                       self.detect_timeout, "the roll call")
                except TimeoutError:
                    found = self._roll_call(generation, True) or []
                alive = [m for m in found if m is not None]
                if len(alive) == len(self._members):
                    raise exc  # nobody is gone: not a failure of a peer
                proposal = propose(generation + 1, alive, self._pending(alive))
                store.compare_set(f"g{generation}/next", "", proposal.encode())
            winner = Proposal.decode(store.get(f"g{generation}/next").decode())
            if (self.slot, self.pid) not in [(m.slot, m.pid) for m in winner.members]:
                mark = dead_key(self.slot, self.pid)
                why = (f"a launcher marked it dead: {store.get(mark).decode()}"
                       if store.check([mark]) else
                       f"no answer within detect_timeout={self.detect_timeout:.0f} s")
                raise RuntimeError(
                    f"lockstep.Survivors: rank {self.slot} was counted gone by its peers "
                    f"({why}); it stops here while they go on") from exc
            self._announce(winner)
            try:
                self._enter(winner)
                return
            except Exception as again:  # noqa: BLE001 - a member lost while entering: again
                exc = again

    def _roll_call(self, generation: int, final: bool) -> list[Member | None] | None:
        """Each member's answer (None: gone), or None while one has neither answered nor been
        marked dead by the launcher (``final``: count those gone too)."""
        store, found = self._store, []
        for m in self._members:
            key = f"g{generation}/alive/{m.slot}"
            if store.check([key]):
                pid, step = store.get(key).decode().split(",")
                found.append(Member(m.slot, int(pid), int(step)) if int(pid) == m.pid else None)
            elif final or store.check([dead_key(m.slot, m.pid)]):
                found.append(None)  # marked dead by the launcher, or never answered
            else:
                return None
        return found

    def _pending(self, alive: list[Member]) -> list[Member]:
        """Replacements waiting for a slot that no alive member holds (and still running)."""
        taken = {m.slot for m in alive}
        joining = []
        for slot in range(self.slots):
            if slot in taken or not self._store.check([f"join/{slot}"]):
                continue
            pid = int(self._store.get(f"join/{slot}"))
            if not self._store.check([dead_key(slot, pid)]):
                joining.append(Member(slot, pid, -1))
        return joining

    def _announce(self, proposal: Proposal) -> None:
        """Tell the replacements in ``proposal`` which generation they are in."""
        for m in proposal.members:
            if m.step == -1:
                self._store.set(f"admitted/{m.slot}/{m.pid}", proposal.encode())

    def _admit(self) -> None:
        """A step boundary while the world is short: the first member admits replacements."""
        generation, key = self.generation, f"g{self.generation}/admit/{self.completed}"
        if self._members[0].slot == self.slot:
            me = [Member(m.slot, m.pid, self.completed) for m in self._members]
            joining = self._pending(me)
            decision = propose(generation + 1, me, joining).encode() if joining else "none"
            if joining:
                self._store.compare_set(f"g{generation}/next", "", decision)
            self._store.set(key, decision)
        store, first = self._store, self._members[0]

        def decided() -> str | None:
            if store.check([key]):
                return store.get(key).decode()
            gone = (store.check([f"g{generation}/failed"])
                    or store.check([dead_key(first.slot, first.pid)]))
            return "failed" if gone else None

        # As long as a collective may wait: the first member may be in a long step.
        decision = wait_until(decided, self.timeout.total_seconds(),
                              "the first member's admission", poll=0.002)
        if decision == "failed":
            self._recover(RuntimeError(f"rank {first.slot} failed before an admission"))
            return
        if decision == "none":
            return
        winner = Proposal.decode(store.get(f"g{generation}/next").decode())
        if decision != winner.encode():  # a failure won the race: recover instead
            self._recover(RuntimeError("a member failed during an admission"))
            return
        self._announce(winner)
        self._enter(winner)

    def _join(self) -> None:
        """A replacement's first step: ask for the slot, wait to be admitted, take the state."""
        store = self._store
        store.set(f"join/{self.slot}", str(self.pid))
        key = f"admitted/{self.slot}/{self.pid}"

        def admitted() -> str | None:
            if store.check([key]):
                return store.get(key).decode()
            return "done" if store.check(["done"]) else None

        found = wait_until(admitted, self.join_timeout, f"admission to slot {self.slot}", 0.05)
        if found == "done":
            raise SystemExit(0)  # the job finished before this replacement was needed
        self._joining = False
        self._enter(Proposal.decode(found))
