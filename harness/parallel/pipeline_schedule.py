"""Pipeline schedules as explicit per-rank action lists, and a communication-free simulator.

Pure Python (no torch): the lists are built and checked in the parent before any rank runs, and
``tests/test_pipeline_schedule.py`` tests them directly.

The model is cut into ``pp * vs`` stages; stage ``s`` lives on pp coordinate ``s % pp`` (with
``vs`` virtual stages per rank, rank ``r`` holds stages ``r, r + pp, r + 2pp, ...``). A rank's list
holds six kinds of action on (stage, microbatch):

    F   forward of the stage          SF  send its output to the rank of stage s+1
    B   backward of the stage         RF  receive the input of stage s (the output of s-1)
                                      SB  send its input gradient to the rank of stage s-1
                                      RB  receive the gradient of its output (from stage s+1)

Communication is placed by :func:`with_comms` from the compute order alone: a receive right before
the compute that needs it, a send right after the compute that produced it. The executor
(``harness/parallel/pipeline.py``) runs the list as written: sends are non-blocking (``isend``, waited
for at the end), receives block. :func:`simulate` runs the lists under exactly those semantics,
with per-pair FIFO channels (what NCCL and gloo give without tags), and rejects a list where

* a rank lists a stage it does not hold, or a peer that does not hold the neighbouring stage;
* a forward or backward is missing or repeated, a backward comes before its forward, or a compute
  runs before its input arrived (or a send before its payload exists);
* a receive would get another message than the one it expects (channel order);
* every unfinished rank waits on a receive nobody will satisfy (deadlock);
* a message is sent and never received.

Each message names the rank, the action, the stage and the microbatch. The simulator also times
the schedule (forward 1 unit, backward ``bwd_cost`` units, communication free) and :func:`table`
draws it as a time x rank grid, so the bubble is visible::

    python -m harness.parallel.pipeline_schedule 1f1b --pp 4 --microbatches 8
    python -m harness.parallel.pipeline_schedule interleaved --pp 4 --microbatches 8 --virtual 2
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from harness.config import ConfigError

F, B, SF, RF, SB, RB = "F", "B", "SF", "RF", "SB", "RB"
COMPUTE = (F, B)
KINDS = (F, B, SF, RF, SB, RB)


class ScheduleError(ConfigError):
    """A schedule the simulator rejects; the message names rank, action, stage and microbatch."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's list. ``peer``: pp coordinate at the other end (communication only)."""

    kind: str
    stage: int
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        where = f" {'to' if self.kind in (SF, SB) else 'from'} rank {self.peer}" if self.peer is not None else ""
        return f"{self.kind}(stage {self.stage}, mb {self.mb}){where}"


@dataclass(frozen=True)
class Schedule:
    """Every pp rank's action list, indexed by pp coordinate."""

    name: str
    pp: int
    microbatches: int
    virtual: int
    lists: tuple[tuple[Action, ...], ...]

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """pp coordinate holding ``stage`` (looped placement: stage s on s % pp)."""
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [rank + k * self.pp for k in range(self.virtual)]

    def replace_list(self, rank: int, actions) -> "Schedule":
        """A copy with rank ``rank``'s list replaced (tests plant broken lists this way)."""
        lists = list(self.lists)
        lists[rank] = tuple(actions)
        return Schedule(self.name, self.pp, self.microbatches, self.virtual, tuple(lists))


# ---- list builders ---------------------------------------------------------------------------

def gpipe_order(pp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """All forwards, then all backwards (in the same microbatch order)."""
    return [(F, rank, m) for m in range(microbatches)] + [(B, rank, m) for m in range(microbatches)]


def one_f_one_b_order(pp: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """Warm up with ``pp - 1 - rank`` forwards, then alternate one forward and one backward."""
    warmup = min(pp - 1 - rank, microbatches)
    order = [(F, rank, m) for m in range(warmup)]
    for m in range(microbatches - warmup):
        order += [(F, rank, warmup + m), (B, rank, m)]
    order += [(B, rank, m) for m in range(microbatches - warmup, microbatches)]
    return order


def rounds(pp: int, microbatches: int) -> int:
    """Rounds of the interleaved schedule: ``max(1, m // pp)``; each round is ``m / rounds`` microbatches."""
    return max(1, microbatches // pp)


def interleaved_order(pp: int, microbatches: int, rank: int, virtual: int) -> list[tuple[str, int, int]]:
    """Interleaved 1F1B (Narayanan et al. 2021), with PyTorch's rounds for any ``m``.

    Microbatches go in rounds of ``g = m / rounds`` (``g = pp`` when pp divides m): a rank runs the
    forwards of a round on its first local stage, then on its second, and so on; backwards go
    through its local stages in reverse. Warmup: ``(vs - 1) * g + 2 * (pp - 1 - rank)`` forwards.
    """
    group = microbatches // rounds(pp, microbatches)
    total = microbatches * virtual
    warmup = min((virtual - 1) * group + 2 * (pp - 1 - rank), total)
    next_mb: dict[tuple[str, int], int] = defaultdict(int)

    def forward(step: int):
        stage = (step // group) % virtual * pp + rank
        m, next_mb[F, stage] = next_mb[F, stage], next_mb[F, stage] + 1
        return (F, stage, m)

    def backward(step: int):
        stage = (virtual - 1 - (step // group) % virtual) * pp + rank
        m, next_mb[B, stage] = next_mb[B, stage], next_mb[B, stage] + 1
        return (B, stage, m)

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def with_comms(order: list[tuple[str, int, int]], pp: int, stages: int) -> tuple[Action, ...]:
    """The compute order with its receives and sends, peers derived from stage placement (s % pp)."""
    rank_of = lambda s: s % pp  # noqa: E731
    out: list[Action] = []
    for kind, s, m in order:
        me = rank_of(s)
        if kind == F:
            if s > 0 and rank_of(s - 1) != me:
                out.append(Action(RF, s, m, rank_of(s - 1)))
            out.append(Action(F, s, m))
            if s < stages - 1 and rank_of(s + 1) != me:
                out.append(Action(SF, s, m, rank_of(s + 1)))
        else:
            if s < stages - 1 and rank_of(s + 1) != me:
                out.append(Action(RB, s, m, rank_of(s + 1)))
            out.append(Action(B, s, m))
            if s > 0 and rank_of(s - 1) != me:
                out.append(Action(SB, s, m, rank_of(s - 1)))
    return tuple(out)


BUILDERS: dict[str, Callable[[int, int, int, int], list[tuple[str, int, int]]]] = {
    "gpipe": lambda pp, m, rank, vs: gpipe_order(pp, m, rank),
    "1f1b": lambda pp, m, rank, vs: one_f_one_b_order(pp, m, rank),
    "interleaved": interleaved_order,
}
# Virtual stages per rank each schedule runs: exactly 1, or at least 2.
VIRTUAL = {"gpipe": "one", "1f1b": "one", "interleaved": "several"}


def build(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """Every rank's action list for schedule ``name`` (not yet checked: see :func:`simulate`)."""
    if name not in BUILDERS:
        raise ConfigError(f"unknown pipeline schedule {name!r}; known: {', '.join(BUILDERS)}")
    lists = tuple(with_comms(BUILDERS[name](pp, microbatches, r, virtual), pp, pp * virtual) for r in range(pp))
    return Schedule(name, pp, microbatches, virtual, lists)


# ---- the simulator ---------------------------------------------------------------------------

def payload(a: Action) -> tuple[str, int, int]:
    """What a communication action carries: the activation leaving a stage or the gradient leaving it."""
    if a.kind == SF:
        return ("activation", a.stage, a.mb)  # output of stage s
    if a.kind == RF:
        return ("activation", a.stage - 1, a.mb)
    if a.kind == SB:
        return ("gradient", a.stage, a.mb)  # gradient of stage s's input
    return ("gradient", a.stage + 1, a.mb)  # RB


def _say(carried: tuple[str, int, int]) -> str:
    what, stage, mb = carried
    side = "output" if what == "activation" else "input gradient"
    return f"the {side} of stage {stage} microbatch {mb}"


@dataclass
class Timeline:
    """When each rank computed what: ``slots[rank]`` = list of (start, end, action)."""

    schedule: Schedule
    bwd_cost: int
    slots: dict[int, list[tuple[int, int, Action]]] = field(default_factory=dict)

    @property
    def makespan(self) -> int:
        return max((end for s in self.slots.values() for _, end, _ in s), default=0)

    def busy(self, rank: int) -> int:
        return sum(end - start for start, end, _ in self.slots[rank])


def _static_checks(sched: Schedule) -> None:
    """Per-rank checks that need no simulation: placement, peers, completeness, order of use."""
    pp, n, stages = sched.pp, sched.microbatches, sched.stages
    if len(sched.lists) != pp:
        raise ScheduleError(f"{sched.name}: {len(sched.lists)} action lists for pp={pp} ranks")
    for rank, actions in enumerate(sched.lists):
        done: set[tuple[str, int, int]] = set()  # (kind, stage, mb) already executed on this rank
        for i, a in enumerate(actions):
            where = f"{sched.name}: rank {rank} action {i} {a}"
            if a.kind not in KINDS:
                raise ScheduleError(f"{where}: unknown kind {a.kind!r}; known: {', '.join(KINDS)}")
            if not (0 <= a.stage < stages and 0 <= a.mb < n):
                raise ScheduleError(f"{where}: stage must be in 0..{stages - 1} and microbatch in 0..{n - 1}")
            if sched.rank_of(a.stage) != rank:
                raise ScheduleError(f"{where}: stage {a.stage} lives on rank {sched.rank_of(a.stage)}, not rank {rank}")
            if a.kind in COMPUTE:
                if (a.kind, a.stage, a.mb) in done:
                    raise ScheduleError(f"{where}: rank {rank} runs the {'forward' if a.kind == F else 'backward'} "
                                        f"of stage {a.stage} microbatch {a.mb} twice")
            else:
                neighbour = a.stage + 1 if a.kind in (SF, RB) else a.stage - 1
                if not 0 <= neighbour < stages:
                    raise ScheduleError(f"{where}: stage {a.stage} has no stage {neighbour} to talk to")
                if a.peer != sched.rank_of(neighbour):
                    raise ScheduleError(f"{where}: stage {neighbour} lives on rank {sched.rank_of(neighbour)}, "
                                        f"not rank {a.peer}")
            need = _needs(sched, a)
            if need is not None and need not in done:
                raise ScheduleError(f"{where}: {_explain(a, need)} (rank {rank}, stage {a.stage}, microbatch {a.mb})")
            done.add((a.kind, a.stage, a.mb))
        for s in sched.stages_of(rank):
            for m in range(n):
                for kind, word in ((F, "forward"), (B, "backward")):
                    if (kind, s, m) not in done:
                        raise ScheduleError(f"{sched.name}: rank {rank} never runs the {word} of stage {s} microbatch {m}")


def _needs(sched: Schedule, a: Action) -> tuple[str, int, int] | None:
    """The earlier action of the same rank that ``a`` depends on, or None."""
    last, local = sched.stages - 1, lambda s: sched.rank_of(s) == sched.rank_of(a.stage)
    if a.kind == F and a.stage > 0:
        return (F, a.stage - 1, a.mb) if local(a.stage - 1) else (RF, a.stage, a.mb)
    if a.kind == B:
        if a.stage == last:
            return (F, a.stage, a.mb)
        return (B, a.stage + 1, a.mb) if local(a.stage + 1) else (RB, a.stage, a.mb)
    if a.kind == SF:
        return (F, a.stage, a.mb)
    if a.kind == SB:
        return (B, a.stage, a.mb)
    return None


def _explain(a: Action, need: tuple[str, int, int]) -> str:
    kind, stage, mb = need
    if a.kind == B and kind in (F, RB):
        return f"backward of stage {a.stage} microbatch {a.mb} comes before " + (
            "its forward" if kind == F else "the gradient of its output is received")
    if a.kind == B and kind == B:
        return f"backward of stage {a.stage} microbatch {a.mb} comes before the backward of stage {stage} it follows"
    if a.kind == F:
        return f"forward of stage {a.stage} microbatch {a.mb} comes before its input " + (
            "is received" if kind == RF else f"is computed by stage {stage}")
    return f"{a} comes before the {'forward' if kind == F else 'backward'} that produces what it sends"


def simulate(sched: Schedule, bwd_cost: int = 2) -> Timeline:
    """Run the lists without communication: check them, and time them. Raises :class:`ScheduleError`.

    Sends never block (``isend``); a receive blocks until its sender has sent; each ordered pair of
    ranks is one FIFO channel, so the k-th receive from a peer gets that peer's k-th send to us.
    """
    backward_needs_forward(sched)
    _static_checks(sched)
    pp = sched.pp
    channels: dict[tuple[int, int], list[tuple[tuple, int]]] = defaultdict(list)  # (src, dst) -> [(payload, time)]
    taken: dict[tuple[int, int], int] = defaultdict(int)
    pos, clock = [0] * pp, [0] * pp
    timeline = Timeline(sched, bwd_cost, {r: [] for r in range(pp)})
    while True:
        progressed = False
        for r in range(pp):
            actions = sched.lists[r]
            while pos[r] < len(actions):
                a = actions[pos[r]]
                if a.kind in COMPUTE:
                    cost = 1 if a.kind == F else bwd_cost
                    timeline.slots[r].append((clock[r], clock[r] + cost, a))
                    clock[r] += cost
                elif a.kind in (SF, SB):
                    channels[r, a.peer].append((payload(a), clock[r]))
                else:
                    queue, k = channels[a.peer, r], taken[a.peer, r]
                    if k >= len(queue):
                        break  # blocked: the peer has not sent it yet
                    carried, sent = queue[k]
                    if carried != payload(a):
                        raise ScheduleError(
                            f"{sched.name}: rank {r} action {pos[r]} {a} expects {_say(payload(a))} "
                            f"(stage {a.stage}, microbatch {a.mb}), but the next message from rank {a.peer} "
                            f"is {_say(carried)}: the two ranks disagree on the order of their messages")
                    taken[a.peer, r] = k + 1
                    clock[r] = max(clock[r], sent)
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(sched.lists[r]) for r in range(pp)):
            break
        if not progressed:
            raise ScheduleError(_deadlock(sched, pos, channels, taken))
    for (src, dst), queue in sorted(channels.items()):
        if taken[src, dst] < len(queue):
            left = queue[taken[src, dst]][0]
            raise ScheduleError(f"{sched.name}: rank {src} sends {_say(left)} (stage {left[1]}, "
                                f"microbatch {left[2]}) to rank {dst}, which never receives it")
    return timeline


def backward_needs_forward(sched: Schedule) -> None:
    """On every rank, each microbatch's forward precedes its backward on every stage it holds."""
    for rank, actions in enumerate(sched.lists):
        seen: set[tuple[int, int]] = set()
        for i, a in enumerate(actions):
            if a.kind == F:
                seen.add((a.stage, a.mb))
            elif a.kind == B and (a.stage, a.mb) not in seen:
                raise ScheduleError(f"{sched.name}: rank {rank} action {i}: backward of stage {a.stage} "
                                    f"microbatch {a.mb} comes before its forward")


def _deadlock(sched: Schedule, pos: list[int], channels, taken) -> str:
    lines = [f"{sched.name}: deadlock, no rank can move on (pp={sched.pp}, m={sched.microbatches}, vs={sched.virtual}):"]
    for r in range(sched.pp):
        if pos[r] == len(sched.lists[r]):
            lines.append(f"  rank {r}: finished")
            continue
        a = sched.lists[r][pos[r]]
        lines.append(f"  rank {r} waits at action {pos[r]} {a} for {_say(payload(a))}, which rank {a.peer} has not sent")
    return "\n".join(lines)


# ---- the time x rank table -------------------------------------------------------------------

def table(timeline: Timeline) -> str:
    """A time x rank grid: ``F3`` forward of microbatch 3 (``F3.1``: on virtual stage 1), ``.`` idle."""
    sched = timeline.schedule
    span = timeline.makespan

    def label(a: Action) -> str:
        chunk = f".{a.stage // sched.pp}" if sched.virtual > 1 else ""
        return f"{a.kind}{a.mb}{chunk}"

    width = max([len(label(a)) for s in timeline.slots.values() for _, _, a in s] + [len(str(span - 1)), 1])
    cells = {r: ["." * 1] * span for r in range(sched.pp)}
    for r, slots in timeline.slots.items():
        for start, end, a in slots:
            for t in range(start, end):
                cells[r][t] = label(a)
    head = f"{sched.name}: pp={sched.pp} microbatches={sched.microbatches} virtual={sched.virtual} " \
           f"(forward 1, backward {timeline.bwd_cost} time units; communication free)"
    times = "time    " + " ".join(str(t).rjust(width) for t in range(span))
    rows = [head, times]
    for r in range(sched.pp):
        idle = 1 - timeline.busy(r) / span if span else 0.0
        rows.append(f"rank {r:<3}" + " ".join(c.rjust(width) for c in cells[r]) + f"   bubble {idle:.0%}")
    return "\n".join(rows)


def describe(name: str, pp: int, microbatches: int, virtual: int = 1, bwd_cost: int = 2, actions: bool = False) -> str:
    """The table of a built and checked schedule (and, with ``actions``, every rank's list)."""
    sched = build(name, pp, microbatches, virtual)
    text = table(simulate(sched, bwd_cost))
    if actions:
        for r, acts in enumerate(sched.lists):
            text += f"\nrank {r}: " + ", ".join(map(str, acts))
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.parallel.pipeline_schedule", description=__doc__.split("\n")[0])
    parser.add_argument("schedule", choices=sorted(BUILDERS))
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--microbatches", "-m", type=int, required=True)
    parser.add_argument("--virtual", "--vs", type=int, default=None, help="virtual stages per rank (interleaved: default 2)")
    parser.add_argument("--backward-cost", type=int, default=2, help="time units of a backward (a forward is 1)")
    parser.add_argument("--actions", action="store_true", help="also print every rank's action list")
    args = parser.parse_args(argv)
    virtual = args.virtual or (2 if VIRTUAL[args.schedule] == "several" else 1)
    print(describe(args.schedule, args.pp, args.microbatches, virtual, args.backward_cost, args.actions))


if __name__ == "__main__":
    main()
