"""Executable model of the pipeline protocol of ``PersistentGemmSm100`` (submission.py).

One CTA pair (cluster) is modelled at a time; the pairs of a launch share nothing but the
read-only tile table, so a launch is its clusters run one after another. Per CTA the agents
are the kernel's warps: the TMA warp, the MMA warp and the four epilogue warps. Each agent is
a generator that follows the kernel's code (pipeline states, try-wait peeks, tails) and yields
at every point where the hardware could switch to another warp. A seeded scheduler picks a
runnable agent or an asynchronous completion at random:

  * TMA loads, per CTA and k-tile its A, B and SFA into its own stage and its half of SFB
    multicast into both CTAs' stages: each lands its data in shared memory and its bytes on
    the leader's ``ab_full`` barrier, in any order and after any delay;
  * the tensor core: MMAs and ``tcgen05.commit`` arrivals complete in issue order (one FIFO
    per pair), each after any delay; a commit multicast arrives on every barrier it names
    when it completes;
  * TMA stores of C subtiles: each finishes reading shared memory after any delay.

Thread arrivals on mbarriers (local or remote) and named barriers take effect at once.

mbarriers follow PTX: a pending-arrival count reset to the init count at every phase, a signed
transaction count, a phase completing when both reach zero, and ``try_wait.parity(p)``
passing while the current phase bit differs from ``p``. On top of the parity semantics the
model knows which completion each wait means (the n-th use of a stage) and reports

  * ``deadlock``: nothing can run or complete while some agent has not finished;
  * ``aliasing``: a barrier completes a phase while an agent that still has to observe the
    phase before it has not (a parity wait would then block for a whole phase or pass a
    phase early), or a parity wait passes on another completion than the one it means;
  * ``race``: a TMA load overwrites a stage that issued MMAs still read, an MMA reads a stage
    whose loads for its k-tile have not all landed, an MMA writes an accumulator an epilogue
    warp still reads, an epilogue warp reads an accumulator that does not hold its tile's
    finished sum, a C subtile overwrites a buffer a TMA store still reads;
  * ``overflow``: more arrivals than a barrier's count in one phase, or a transaction count
    out of the PTX range;
  * ``exit``: a CTA whose warps have all finished still has loads, MMAs, commits or stores in
    flight that touch it.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque

LEADER, PEER = 0, 1
NUM_EPILOGUE_WARPS = 4
# The MMA's M per CTA (problem N rows) and the K tile in bytes of packed fp4 (256 values)
ROWS_PER_CTA = 128
K_TILE = 256
K_TILE_BYTES = K_TILE // 2
SF_BYTES_PER_ROW = K_TILE // 16
# Bytes of one C element (fp16)
C_ELEM_BYTES = 2


class ProtocolError(AssertionError):
    """A broken protocol: ``kind`` is one of deadlock, aliasing, race, overflow, exit."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclasses.dataclass(frozen=True)
class Protocol:
    """What the kernel's barriers, stages and warps are; the defaults are the kernel's.

    The fields after ``epilogue_subtiles`` default to the kernel's barrier counts, start
    phases, stage counts and multicasts; the tests' negative checks change them to break the
    protocol on purpose.
    """

    num_ab_stage: int
    num_acc_stage: int
    num_c_stage: int
    # Bytes of A, B, SFA and one SFB half that one CTA's TMA warp issues per k-tile; the SFB
    # half is multicast to both CTAs, so it lands twice
    a_bytes: int
    b_bytes: int
    sfa_bytes: int
    sfb_half_bytes: int
    epilogue_subtiles: int
    # ab_full: arrival count and the bytes the leader's arrive expects per phase
    ab_full_count: int = 1
    ab_full_expect_tx: int | None = None  # None: both CTAs' stage bytes
    ab_empty_count: int = 1
    acc_full_count: int = 1
    acc_empty_count: int = 2 * NUM_EPILOGUE_WARPS
    tmem_dealloc_count: int = 32
    # Stage counts the TMA and MMA warps' pipeline states wrap at (None: num_ab_stage)
    tma_stages: int | None = None
    mma_stages: int | None = None
    ab_producer_phase: int = 1
    ab_consumer_phase: int = 0
    acc_producer_phase: int = 1
    acc_consumer_phase: int = 0
    peer_tma_waits_empty: bool = True
    ab_release_ctas: tuple[int, ...] = (LEADER, PEER)
    acc_full_ctas: tuple[int, ...] = (LEADER, PEER)
    # Subtile at which an epilogue warp releases the accumulator (None: the last one, after
    # its TMEM load)
    acc_release_subtile: int | None = None

    @classmethod
    def from_config(cls, config) -> Protocol:
        """The protocol of ``PersistentGemmSm100(config)`` (a ``PersistentGemmConfig``)."""
        tokens = config.tokens_per_tile
        protocol = cls(
            num_ab_stage=config.num_ab_stage,
            num_acc_stage=config.num_acc_stage,
            num_c_stage=config.num_c_stage,
            a_bytes=ROWS_PER_CTA * K_TILE_BYTES,
            b_bytes=tokens // 2 * K_TILE_BYTES,
            sfa_bytes=ROWS_PER_CTA * SF_BYTES_PER_ROW,
            sfb_half_bytes=max(tokens, 128) * SF_BYTES_PER_ROW // 2,
            epilogue_subtiles=ROWS_PER_CTA * tokens * C_ELEM_BYTES // config.c_stage_bytes,
        )
        if protocol.stage_bytes != config.ab_stage_bytes:
            raise ValueError(
                f"operand bytes {protocol.stage_bytes} != config.ab_stage_bytes {config.ab_stage_bytes}"
            )
        return protocol

    @property
    def stage_bytes(self) -> int:
        """Bytes one CTA's loads of one k-tile land (A, B, SFA, both CTAs' copy of its SFB half)."""
        return self.a_bytes + self.b_bytes + self.sfa_bytes + 2 * self.sfb_half_bytes

    @property
    def expect_tx(self) -> int:
        return 2 * self.stage_bytes if self.ab_full_expect_tx is None else self.ab_full_expect_tx


# =============================================================================
# Primitives
# =============================================================================
TX_LIMIT = (1 << 20) - 1


class MBarrier:
    """A shared-memory mbarrier as PTX describes it, plus who still has to observe its phases."""

    __slots__ = ("changed", "completed", "count", "cta", "name", "observed", "pending", "tx", "waiters")

    def __init__(self, name: str, cta: int, count: int, changed: list):
        self.name = name
        self.cta = cta
        self.count = count
        self.pending = count
        self.tx = 0
        self.completed = 0  # completed phases; the current phase bit is completed & 1
        self.observed: dict[str, int] = {}  # agent -> the last completion it observed
        self.waiters: list[Agent] = []
        self.changed = changed

    def arrive(self, arrivals: int = 1, expect_tx: int = 0) -> None:
        # mbarrier.arrive.expect_tx: the expect-tx operation comes before the arrive-on
        self.tx += expect_tx
        self.pending -= arrivals
        if self.pending < 0:
            raise ProtocolError("overflow", f"{self.name}: more than {self.count} arrivals in phase {self.completed}")
        self._settle()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._settle()

    def _settle(self) -> None:
        if abs(self.tx) > TX_LIMIT:
            raise ProtocolError("overflow", f"{self.name}: transaction count {self.tx}")
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count
            for agent, seen in self.observed.items():
                if self.completed >= seen + 2:
                    raise ProtocolError(
                        "aliasing",
                        f"{self.name} completed phase {self.completed - 1} before {agent} "
                        f"observed phase {seen}",
                    )
            if self.waiters:
                self.changed.append(self)

    def parity_passes(self, parity: int) -> bool:
        """mbarrier.try_wait.parity: true once the phase with this parity has completed."""
        return (self.completed & 1) != parity

    def describe(self) -> str:
        return f"{self.name}(completed={self.completed}, pending={self.pending}, tx={self.tx})"


class NamedBarrier:
    """bar.sync among a fixed number of warps."""

    __slots__ = ("arrived", "changed", "deferred", "generation", "name", "waiters", "warps")

    def __init__(self, name: str, warps: int, changed: list):
        self.name = name
        self.warps = warps
        self.arrived = 0
        self.deferred = 0  # arrivals already made for the next generation
        self.generation = 0
        self.waiters: list[Agent] = []
        self.changed = changed

    def sync(self, twice: bool = False) -> BarSync:
        """Arrive; the returned wait passes once this generation completes. `twice`: a warp
        with nothing to do between two syncs arrives at the second one as the first completes
        (any later arrival only delays the second, like a slower warp)."""
        target = self.generation + (2 if twice else 1)
        self.deferred += twice
        self.arrived += 1
        while self.arrived == self.warps:
            self.generation += 1
            self.arrived, self.deferred = self.deferred, 0
            if self.waiters:
                self.changed.append(self)
        return BarSync(self, target)


class StoreQueue:
    """The TMA store groups one thread committed: [C buffer, finished reading shared memory]."""

    __slots__ = ("changed", "groups", "name", "waiters")

    def __init__(self, name: str, changed: list):
        self.name = name
        self.groups: list[list] = []
        self.waiters: list[Agent] = []
        self.changed = changed

    def reading(self, buffer: int) -> bool:
        return any(b == buffer and not finished for b, finished in self.groups)

    def finish(self, group: list) -> None:
        group[1] = True
        while self.groups and self.groups[0][1]:
            del self.groups[0]  # the oldest groups are done: wait_group no longer counts them
        if self.waiters:
            self.changed.append(self)


class PipelineState:
    """cutlass.pipeline.PipelineState: index, phase and count of a circular buffer."""

    __slots__ = ("count", "index", "phase", "stages")

    def __init__(self, stages: int, phase: int):
        self.stages = stages
        self.index = 0
        self.phase = phase
        self.count = 0

    def advance(self) -> None:
        self.index += 1
        self.count += 1
        if self.index == self.stages:
            self.index = 0
            self.phase ^= 1

    def reset_count(self) -> None:
        self.count = 0


class Wait:
    """A blocking parity wait on an mbarrier; `target` is the completion the agent means."""

    __slots__ = ("parity", "source", "target")

    def __init__(self, barrier: MBarrier, parity: int, target: int):
        self.source = barrier
        self.parity = parity
        self.target = target

    def ready(self) -> bool:
        return (self.source.completed & 1) != self.parity

    def describe(self) -> str:
        return f"wait {self.source.describe()} parity {self.parity} for completion {self.target}"


class BarSync:
    __slots__ = ("source", "target")

    def __init__(self, barrier: NamedBarrier, target: int):
        self.source = barrier
        self.target = target

    def ready(self) -> bool:
        return self.source.generation >= self.target

    def describe(self) -> str:
        return f"bar.sync {self.source.name} ({self.source.arrived}/{self.source.warps} arrived)"


class StoreWait:
    """cp.async.bulk.wait_group.read N: all but the N most recent store groups have read smem."""

    __slots__ = ("keep", "source")

    def __init__(self, queue: StoreQueue, keep: int):
        self.source = queue
        self.keep = keep

    def ready(self) -> bool:
        groups = self.source.groups
        return all(group[1] for group in groups[: len(groups) - self.keep])

    def describe(self) -> str:
        reading = sum(not g[1] for g in self.source.groups)
        return f"wait_group.read {self.keep} on {self.source.name} ({reading} stores reading)"


class Agent:
    __slots__ = ("blocker", "cta", "done", "k_tiles", "name", "program", "slow", "tiles", "uses")

    def __init__(self, name: str, cta: int):
        self.name = name
        self.cta = cta
        self.program = None
        self.blocker = None
        self.done = False
        self.tiles: list[int] = []
        self.k_tiles = 0
        self.slow = False
        self.uses: dict[str, int] = {}  # barrier -> how many times this agent waited on it


@dataclasses.dataclass
class ClusterResult:
    """Per agent: the tile-table entries it processed (in order) and its k-tile count."""

    tiles: dict[str, list[int]]
    k_tiles: dict[str, int]
    steps: int
    # Most k-tiles the leader's TMA warp had issued ahead of the MMA warp at once
    max_stages_ahead: int
    # Barriers left mid-phase at the end (the leader TMA's tail arrive leaves one ab_full armed)
    leftover: list[str]


# =============================================================================
# The model of one CTA pair
# =============================================================================
class ClusterModel:
    """The agents, barriers and buffers of one CTA pair running `tiles`: a list of
    (tile-table index, k-tiles) in the order the pair walks them."""

    def __init__(self, protocol: Protocol, tiles, seed: int):
        self.p = p = protocol
        self.tile_list = [(int(t), int(k)) for t, k in tiles]
        self.rng = random.Random(seed)
        self.changed: list = []  # barriers and queues whose waiters may have become runnable

        def barriers(name, count, num):
            return [[MBarrier(f"cta{c}.{name}[{i}]", c, count, self.changed) for i in range(num)]
                    for c in (LEADER, PEER)]

        self.ab_full = barriers("ab_full", p.ab_full_count, p.num_ab_stage)
        self.ab_empty = barriers("ab_empty", p.ab_empty_count, p.num_ab_stage)
        self.acc_full = barriers("acc_full", p.acc_full_count, p.num_acc_stage)
        self.acc_empty = barriers("acc_empty", p.acc_empty_count, p.num_acc_stage)
        self.tmem_dealloc = [MBarrier(f"cta{c}.tmem_dealloc", c, p.tmem_dealloc_count, self.changed)
                             for c in (LEADER, PEER)]
        # tmem_alloc_barrier (the MMA warp and the epilogue warps) and epilog_sync_barrier
        self.alloc_bar = [NamedBarrier(f"cta{c}.tmem_alloc", 1 + NUM_EPILOGUE_WARPS, self.changed)
                          for c in (LEADER, PEER)]
        self.epi_bar = [NamedBarrier(f"cta{c}.epilog_sync", NUM_EPILOGUE_WARPS, self.changed)
                        for c in (LEADER, PEER)]
        self.stores = [StoreQueue(f"cta{c}.c_stores", self.changed) for c in (LEADER, PEER)]
        # Shared memory: per CTA and stage, data -> the (tile, k) it holds (None: being written)
        self.smem = [[{} for _ in range(p.num_ab_stage)] for _ in (LEADER, PEER)]
        self.mma_reads = [0] * p.num_ab_stage  # issued MMAs that still read a stage
        self.acc = [None] * p.num_acc_stage  # (tile, k-tiles summed) as the MMAs complete
        self.acc_readers: list[set] = [set() for _ in range(p.num_acc_stage)]
        self.tmem_freed = [False, False]
        # Loads and stores in flight, completing in any order: (CTAs touched, fire, what)
        self.in_flight: list = []
        # MMAs and commits, completing in issue order: (CTAs touched, fire, what)
        self.tensor_core: deque = deque()
        self.stages_ahead = 0
        self.max_stages_ahead = 0
        self.agents = self._make_agents()

    # ------------------------------------------------------------------ agents
    def _make_agents(self) -> list[Agent]:
        agents = []
        for c in (LEADER, PEER):
            tma = Agent(f"cta{c}.tma", c)
            tma.program = self._tma(tma)
            if c == LEADER or self.p.peer_tma_waits_empty:
                self._observe_from_start(tma, self.ab_empty[c])
            mma = Agent(f"cta{c}.mma", c)
            mma.program = self._mma_leader(mma) if c == LEADER else self._mma_peer(mma)
            if c == LEADER:
                self._observe_from_start(mma, self.ab_full[LEADER] + self.acc_empty[LEADER])
            agents += [tma, mma]
            for w in range(NUM_EPILOGUE_WARPS):
                epi = Agent(f"cta{c}.epilogue{w}", c)
                epi.program = self._epilogue(epi, w)
                self._observe_from_start(epi, self.acc_full[c] + ([self.tmem_dealloc[c]] if w == 0 else []))
                agents.append(epi)
        slow_share = self.rng.choice((0.0, 0.25, 0.5))
        for agent in agents:
            agent.slow = self.rng.random() < slow_share
        return agents

    @staticmethod
    def _observe_from_start(agent: Agent, barriers) -> None:
        for barrier in barriers:
            barrier.observed[agent.name] = 0

    def _wait(self, agent: Agent, barrier: MBarrier, parity: int, producer: bool) -> Wait:
        """The agent's next wait on `barrier`: a producer's use n (from 0) of a buffer needs n
        releases, a consumer's use n needs n + 1 fills."""
        use = agent.uses.get(barrier.name, 0)
        agent.uses[barrier.name] = use + 1
        return Wait(barrier, parity, use if producer else use + 1)

    def _try_wait(self, agent: Agent, barrier: MBarrier, parity: int, producer: bool) -> bool:
        """try_wait: may report false although the phase has completed (it times out)."""
        if barrier.parity_passes(parity) and self.rng.random() < 0.75:
            self._observe(agent, self._wait(agent, barrier, parity, producer))
            return True
        return False

    @staticmethod
    def _observe(agent: Agent, wait: Wait) -> None:
        barrier = wait.source
        if barrier.completed != wait.target:
            raise ProtocolError(
                "aliasing",
                f"{agent.name}: parity wait on {barrier.describe()} passed for completion {wait.target}",
            )
        if agent.name in barrier.observed:
            barrier.observed[agent.name] = wait.target

    def _stage(self, index: int) -> int:
        if index >= self.p.num_ab_stage:
            raise ProtocolError("overflow", f"stage index {index} of {self.p.num_ab_stage} stages")
        return index

    # The TMA warp of either CTA
    def _tma(self, agent: Agent):
        p = self.p
        c = agent.cta
        state = PipelineState(p.tma_stages or p.num_ab_stage, p.ab_producer_phase)
        empty = self.ab_empty[c]
        waits = c == LEADER or p.peer_tma_waits_empty

        def acquire(peek: bool):
            # PipelineTmaUmma.producer_acquire: wait unless the peek saw the phase, then the
            # leader arms its ab_full with both CTAs' bytes
            s = self._stage(state.index)
            if waits and not peek:
                yield self._wait(agent, empty[s], state.phase, producer=True)
            if c == LEADER:
                self.ab_full[LEADER][s].arrive(1, p.expect_tx)

        def try_acquire() -> bool:
            if not waits:
                return True
            return self._try_wait(agent, empty[self._stage(state.index)], state.phase, producer=True)

        for tile, k_tiles in self.tile_list:
            state.reset_count()
            peek = try_acquire() if state.count < k_tiles else True
            for k in range(k_tiles):
                yield from acquire(peek)
                self._issue_loads(c, state.index, (tile, k))
                agent.k_tiles += 1
                yield None
                state.advance()
                peek = try_acquire() if state.count < k_tiles else True
            agent.tiles.append(tile)
        # PipelineAsync.producer_tail: wait for the release of the last filled buffer (releases
        # come in order, so every buffer is released); the leader's acquire arms ab_full
        for _ in range(state.stages - 1):
            state.advance()
        yield from acquire(False)

    def _issue_loads(self, c: int, s: int, tag) -> None:
        """One CTA's TMA loads of a k-tile: A, B and SFA into its own stage, its half of SFB
        multicast into both CTAs' stages; every byte lands on the leader's ab_full."""
        p = self.p
        if self.mma_reads[s]:
            raise ProtocolError("race", f"cta{c} TMA loads {tag} into stage {s} while MMAs read it")
        own, multicast = f"ab{c}", f"sfb{c}"
        barrier = self.ab_full[LEADER][s]
        for key, dests, nbytes in ((own, (c,), p.a_bytes + p.b_bytes + p.sfa_bytes),
                                   (multicast, (LEADER, PEER), 2 * p.sfb_half_bytes)):
            for d in dests:
                self.smem[d][s][key] = None

            def land(dests=dests, key=key, nbytes=nbytes):
                for d in dests:
                    self.smem[d][s][key] = tag
                barrier.complete_tx(nbytes)

            self.in_flight.append(({LEADER, *dests}, land, f"load {key} {tag}"))
        if c == LEADER:
            self.stages_ahead += 1
            self.max_stages_ahead = max(self.max_stages_ahead, self.stages_ahead)

    # The MMA warp of the leader CTA: every MMA of the pair
    def _mma_leader(self, agent: Agent):
        p = self.p
        ab_state = PipelineState(p.mma_stages or p.num_ab_stage, p.ab_consumer_phase)
        acc_state = PipelineState(p.num_acc_stage, p.acc_producer_phase)
        full = self.ab_full[LEADER]

        def try_wait() -> bool:
            return self._try_wait(agent, full[self._stage(ab_state.index)], ab_state.phase, producer=False)

        yield self.alloc_bar[LEADER].sync()
        for tile, k_tiles in self.tile_list:
            a = acc_state.index
            ab_state.reset_count()
            peek = try_wait() if ab_state.count < k_tiles else False
            yield self._wait(agent, self.acc_empty[LEADER][a], acc_state.phase, producer=True)
            for k in range(k_tiles):
                s = self._stage(ab_state.index)
                if not peek:
                    yield self._wait(agent, full[s], ab_state.phase, producer=False)
                self._issue_mma(tile, k, s, a)
                # consumer_release: tcgen05.commit multicast to the ab_empty of both CTAs
                self._commit([self.ab_empty[c][s] for c in p.ab_release_ctas])
                agent.k_tiles += 1
                yield None
                ab_state.advance()
                peek = try_wait() if ab_state.count < k_tiles else False
            self._commit([self.acc_full[c][a] for c in p.acc_full_ctas])
            agent.tiles.append(tile)
            yield None
            acc_state.advance()
        # PipelineUmmaAsync.producer_tail (leader): wait for the last accumulator's release
        for _ in range(p.num_acc_stage - 1):
            acc_state.advance()
        yield self._wait(agent, self.acc_empty[LEADER][acc_state.index], acc_state.phase, producer=True)

    def _issue_mma(self, tile: int, k: int, s: int, a: int) -> None:
        for c in (LEADER, PEER):
            held = self.smem[c][s]
            missing = [key for key in (f"ab{c}", "sfb0", "sfb1") if held.get(key) != (tile, k)]
            if missing:
                raise ProtocolError("race", f"MMA of tile {tile} k-tile {k} reads cta{c} stage {s} without {missing}")
        if self.acc_readers[a]:
            raise ProtocolError(
                "race", f"MMA of tile {tile} writes accumulator {a} while {sorted(self.acc_readers[a])} read it"
            )
        if any(self.tmem_freed):
            raise ProtocolError("race", f"MMA of tile {tile} after TMEM was freed")
        self.mma_reads[s] += 1
        self.stages_ahead -= 1

        def complete():
            self.mma_reads[s] -= 1
            if k == 0:
                self.acc[a] = (tile, 1)  # ACCUMULATE off: the first k-tile overwrites
            elif self.acc[a] != (tile, k):
                raise ProtocolError("race", f"accumulator {a} holds {self.acc[a]} under tile {tile} k-tile {k}")
            else:
                self.acc[a] = (tile, k + 1)

        self.tensor_core.append(({LEADER, PEER}, complete, f"mma {tile}/{k}"))

    def _commit(self, barriers) -> None:
        def arrive():
            for barrier in barriers:
                barrier.arrive()

        self.tensor_core.append(({b.cta for b in barriers}, arrive, "commit " + " ".join(b.name for b in barriers)))

    # The MMA warp of the peer CTA: only its pipeline states move
    def _mma_peer(self, agent: Agent):
        yield self.alloc_bar[PEER].sync()
        for tile, k_tiles in self.tile_list:
            agent.k_tiles += k_tiles
            agent.tiles.append(tile)
            yield None

    # An epilogue warp
    def _epilogue(self, agent: Agent, w: int):
        p = self.p
        c = agent.cta
        state = PipelineState(p.num_acc_stage, p.acc_consumer_phase)
        release_at = p.epilogue_subtiles - 1 if p.acc_release_subtile is None else p.acc_release_subtile
        stores = self.stores[c]
        bar = self.epi_bar[c]
        reader = (c, w)
        subtiles_done = 0
        yield self.alloc_bar[c].sync()
        for tile, k_tiles in self.tile_list:
            a = state.index
            yield self._wait(agent, self.acc_full[c][a], state.phase, producer=False)
            if self.acc[a] != (tile, k_tiles):
                raise ProtocolError("race", f"{agent.name} reads accumulator {a} = {self.acc[a]} for tile {tile}")
            self.acc_readers[a].add(reader)
            for j in range(p.epilogue_subtiles):
                if j == p.epilogue_subtiles - 1:
                    self.acc_readers[a].discard(reader)  # the last TMEM load (and its fence)
                if j == release_at:
                    # one lane arrives on the leader's acc_empty
                    self.acc_empty[LEADER][a].arrive()
                buffer = (subtiles_done + j) % p.num_c_stage
                if stores.reading(buffer):
                    raise ProtocolError("race", f"{agent.name} writes C buffer {buffer} while a TMA store reads it")
                if w == 0:
                    yield bar.sync()
                    # the elected warp stores the subtile and waits for older stores to read
                    group = [buffer, False]
                    stores.groups.append(group)
                    self.in_flight.append(({c}, lambda group=group: stores.finish(group), f"store {buffer}"))
                    yield StoreWait(stores, p.num_c_stage - 1)
                    yield bar.sync()
                else:
                    yield bar.sync(twice=True)
            agent.tiles.append(tile)
            state.advance()
            subtiles_done += p.epilogue_subtiles
        yield bar.sync()
        if w == 0:
            # TMEM is freed once both CTAs' epilogues are done with it
            self.tmem_dealloc[c ^ 1].arrive(32)
            yield self._wait(agent, self.tmem_dealloc[c], 0, producer=False)
            if any(self.acc_readers) or any(op[2].startswith("mma") for op in self.tensor_core):
                raise ProtocolError("race", f"cta{c} frees TMEM while it is read or written")
            self.tmem_freed[c] = True
            yield StoreWait(stores, 0)

    # ------------------------------------------------------------------ scheduler
    def run(self, max_steps: int = 20_000_000) -> ClusterResult:
        """Run to the end under a seeded random schedule; raises ProtocolError."""
        rng = self.rng
        random_ = rng.random
        ready = list(self.agents)
        live = len(ready)
        changed = self.changed
        in_flight = self.in_flight
        tensor_core = self.tensor_core
        # Per run: how often a completion is picked over a runnable warp
        event_share = rng.choice((0.1, 0.4, 0.8))
        steps = 0
        while live:
            steps += 1
            if steps > max_steps:
                raise ProtocolError("deadlock", f"no end after {max_steps} steps")
            num_events = len(in_flight) + (1 if tensor_core else 0)
            if num_events and (not ready or random_() < event_share):
                pick = int(random_() * num_events)
                if pick == len(in_flight):
                    fire = tensor_core.popleft()[1]
                else:
                    in_flight[pick], in_flight[-1] = in_flight[-1], in_flight[pick]
                    fire = in_flight.pop()[1]
                fire()
            elif ready:
                i = int(random_() * len(ready))
                if ready[i].slow and random_() < 0.8:
                    i = int(random_() * len(ready))
                ready[i], ready[-1] = ready[-1], ready[i]
                agent = ready.pop()
                blocker = agent.blocker
                if blocker is not None:
                    if not blocker.ready():
                        raise ProtocolError("aliasing", f"{agent.name}: {blocker.describe()} passed and failed again")
                    if isinstance(blocker, Wait):
                        self._observe(agent, blocker)
                try:
                    blocker = agent.program.send(None)
                except StopIteration:
                    agent.done = True
                    agent.blocker = None
                    live -= 1
                    self._on_exit(agent.cta)
                else:
                    agent.blocker = blocker
                    if blocker is None or blocker.ready():
                        ready.append(agent)
                    else:
                        blocker.source.waiters.append(agent)
            else:
                blocked = "; ".join(f"{a.name}: {a.blocker.describe()}" for a in self.agents if not a.done)
                raise ProtocolError("deadlock", blocked)
            while changed:
                source = changed.pop()
                still = []
                for agent in source.waiters:
                    (ready if agent.blocker.ready() else still).append(agent)
                source.waiters[:] = still
        if in_flight or tensor_core:
            raise ProtocolError("exit", f"in flight at the end: {[op[2] for op in (*in_flight, *tensor_core)]}")
        return ClusterResult(
            tiles={a.name: a.tiles for a in self.agents},
            k_tiles={a.name: a.k_tiles for a in self.agents},
            steps=steps,
            max_stages_ahead=self.max_stages_ahead,
            leftover=[b.describe() for b in self._barriers() if b.pending != b.count or b.tx],
        )

    def _barriers(self):
        for rows in (self.ab_full, self.ab_empty, self.acc_full, self.acc_empty):
            for row in rows:
                yield from row
        yield from self.tmem_dealloc

    def _on_exit(self, cta: int) -> None:
        """A CTA whose warps have all finished must have nothing in flight that touches it."""
        if any(not a.done for a in self.agents if a.cta == cta):
            return
        in_flight = [what for ctas, _fire, what in (*self.in_flight, *self.tensor_core) if cta in ctas]
        if in_flight:
            raise ProtocolError("exit", f"cta{cta} exits with {in_flight} in flight")


# =============================================================================
# A launch: the host's tile table walked by every cluster
# =============================================================================
def launch_clusters(num_tiles: int, num_sms: int) -> int:
    """Clusters the host launches: min(tiles, SMs / 2), so that every pair has a tile (no launch
    at all without tiles)."""
    return min(num_tiles, max(num_sms // 2, 1))


def kernel_rows(problem_sizes, tiles) -> list[tuple[int, int, int, int]]:
    """The persistent kernel's tile rows for planner entries (g, N tile, token tile): the
    k-tile count K_g / 256 appended."""
    return [(g, n_tile, m_tile, problem_sizes[g][2] // K_TILE) for g, n_tile, m_tile in tiles]


def cluster_tiles(rows, num_clusters: int, cluster: int) -> list[tuple[int, int]]:
    """(row index, k-tiles) of the rows cluster `cluster` walks, as every warp of the kernel
    does: `cluster`, then `num_clusters` rows on while the index is below the row count."""
    walked = []
    index = cluster
    while index < len(rows):
        walked.append((index, rows[index][3]))
        index += num_clusters
    return walked


def simulate_launch(protocol: Protocol, rows, num_sms: int, seed: int) -> list[ClusterResult]:
    """Every cluster of one launch over the tile rows `rows`, each under its own schedule."""
    num_clusters = launch_clusters(len(rows), num_sms)
    return [
        ClusterModel(protocol, cluster_tiles(rows, num_clusters, c), seed * 1_000_003 + c).run()
        for c in range(num_clusters)
    ]
