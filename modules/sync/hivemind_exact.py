"""A hivemind DecentralizedAverager whose all-reduce gives the store backend's exact bytes.

hivemind's own butterfly all-reduce sums each part in arrival order and returns every peer
the *difference* to its own input (compressed), so peers end up with slightly different
values (and hivemind 1.1.12's 8-bit codecs average nothing with numpy >= 2.5). Here, after
hivemind's matchmaking has formed the group (DHT, no central store), the same P2P streams
carry our codes (modules.quant.allreduce: fp16, or int8 blocks + scales) and the arithmetic is
modules.comm.compressed's, written once there:
- peers are ordered by replica number (exchanged in matchmaking's gather), and peer j owns
  chunk j of every segment (`chunk_bounds`, `segment_bounds`), as rank j does in the store;
- the owner decodes its own encoding first, then the others' in replica order, sums in fp32,
  divides by the count (IEEE) and re-encodes the mean once;
- every peer, the owner included, decodes those same bytes: all peers end bit-identical, and
  equal to `reference_compressed_mean` of the same inputs (tests/test_hivemind_outer.py).
A peer with weight 0 (a joiner catching up) sends nothing that counts and receives the mean.
The result is written only when the whole round succeeded (no sender banned, no reducer
lost); otherwise the round raises and hivemind retries it among the peers still there.

A round's group may also come without matchmaking (`ExactAverager._fixed_round`): every
replica forms the same group from the DHT roster it reads anyway (same members, same id), and
each starts its all-reduce when it reaches the round; a part that arrives before its
receiver registered the group waits for it (`rpc_aggregate_part`), up to the group's wait.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any
from typing import AsyncIterator as Stream  # noqa: UP035 - hivemind reads an rpc's types by it

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    enter_asynchronously,
)
from hivemind.utils.streaming import combine_from_streaming

from modules.quant.allreduce import (
    SEGMENT,
    chunk_bounds,
    decode_chunk,
    encode_chunk,
    ieee_div,
    segment_bounds,
)
from modules.quant.codec import DEFAULT_BLOCK
from modules.sync.hivemind_auth import NOT_A_MEMBER, PeerProof
from modules.sync.hivemind_checks import STATE_SOURCES, mean_fault, norm_of, state_fault
from modules.sync.hivemind_dht import hand_over_fds
from modules.sync.hivemind_offenders import ExclusionMixin, screened

STATE_BYTES_PER_VALUE = 4 * (4 + 2)
"""Most bytes per parameter a shared state may take: fp32 model, momentum and the averages of
the last rounds (KEEP_RESULTS), with room to spare."""
FIXED_GROUP = b"fixed:"
"""Prefix of the ids of groups formed from the roster (`ExactAverager._fixed_round`)."""


def fixed_group_id(index: int, text: str) -> bytes:
    """The id of round `index`'s group formed from the roster (`text` names its members)."""
    return FIXED_GROUP + index.to_bytes(8, "big") + hashlib.sha256(text.encode()).digest()[:20]


def fixed_group_round(group_id: bytes) -> int:
    """The round of a group id made by `fixed_group_id`."""
    return int.from_bytes(group_id[len(FIXED_GROUP):len(FIXED_GROUP) + 8], "big")


WHOLE_PARTS = 1 << 40
"""part_size_bytes: every chunk travels as one part (at most SEGMENT / W values), so a part
never cuts a codec block."""


class CodecWire(CompressionBase):
    """Our fp16 / int8 chunk encoding (or fp32 for `none`) inside hivemind's Tensor message."""

    compression_type = runtime_pb2.CompressionType.NONE  # decoded only by our runner

    def __init__(self, compression: str = "int8", block: int = DEFAULT_BLOCK) -> None:
        self.compression, self.block = compression, block

    def compress(self, tensor: torch.Tensor, info: CompressionInfo | None = None,
                 allow_inplace: bool = False) -> runtime_pb2.Tensor:
        """The bytes the store backend sends for this chunk."""
        x = tensor.detach().reshape(-1).to(torch.float32).contiguous()
        if self.compression == "none":
            buf = x.numpy().tobytes()
        else:
            buf = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes()
                           for p in encode_chunk(x, self.compression, self.block))
        return runtime_pb2.Tensor(buffer=buf, size=[x.numel()], dtype="float32",
                                  compression=self.compression_type)

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        """fp32 values back from `compress`'s bytes."""
        numel = int(serialized.size[0]) if serialized.size else 0
        raw = torch.frombuffer(bytearray(serialized.buffer), dtype=torch.uint8)
        if self.compression == "none":
            return raw.view(torch.float32)[:numel].clone()
        if self.compression == "fp16":
            return decode_chunk([raw.view(torch.float16)], numel, "fp16", self.block)
        return decode_chunk([raw], numel, "int8", self.block)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a peer decodes from this encoding of `x`."""
        return self.extract(self.compress(x))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        """Bytes per fp32 byte on the wire (sizes parts; every chunk is one part here)."""
        return {"none": 1.0, "fp16": 0.5}.get(self.compression, 0.25 + 1.0 / self.block)


def reducer_of(world: int, clients: set[int]) -> list[int]:
    """Who reduces chunk j: j itself, or for a --client-mode peer (no incoming streams), the
    peers that accept in turn (the k-th client's chunk to the k-th of them, cyclically)."""
    hosts = [j for j in range(world) if j not in clients]
    if not hosts:
        raise AllreduceException("every peer of the group is in client mode: nobody reduces")
    order = sorted(clients)
    return [j if j not in clients else hosts[order.index(j) % len(hosts)] for j in range(world)]


def owner_views(flat: torch.Tensor, world: int, block: int, segment: int = SEGMENT,
                clients: set[int] | None = None
                ) -> tuple[list[torch.Tensor], list[float], list[list[int]]]:
    """Views of `flat` grouped by the peer that reduces them (chunk j of every segment is
    replica j's, as in modules.comm.compressed; a client's chunk goes to `reducer_of`), the
    number of values each peer reduces, and per peer the chunk (= owner) of each of its views,
    so the reducer sums in the owner's order whoever hosts the chunk."""
    host = reducer_of(world, clients or set())
    views: list[list[torch.Tensor]] = [[] for _ in range(world)]
    owners: list[list[int]] = [[] for _ in range(world)]
    for slo, shi in segment_bounds(flat.numel(), segment, block):
        for j, (lo, hi) in enumerate(chunk_bounds(shi - slo, world, block)):
            if hi > lo:
                views[host[j]].append(flat[slo + lo: slo + hi])
                owners[host[j]].append(j)
    sizes = [float(sum(v.numel() for v in vs)) for vs in views]
    return [v for vs in views for v in vs], sizes, owners


class OrderedReducer(TensorPartReducer):
    """Keeps every sender's part and reduces them in a fixed order when all are in: the
    part's owner's first (`owners[i]`: me, or the client whose chunk I host), then the others
    by sender index (= replica order), weight 0 skipped."""

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, owners: list[int],
                 wire: CodecWire, me: int | None = None, excluded: set[int] | None = None
                 ) -> None:
        """`me`: my sender index (my own part is the norm reference: hivemind_checks);
        `excluded`: senders whose parts are left out whatever they hold (hivemind_offenders)."""
        self.owners, self.wire, self.me, self.excluded = owners, wire, me, excluded or set()
        self.parts: dict[int, tuple[torch.Tensor | None, float]] = {}
        self.rejected: dict[int, str] = {}
        """Sender -> why its part of a chunk was left out (the first reason)."""
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        """Next part: forget the previous one's inputs."""
        self.parts = {}
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int,
                              tensor_part: torch.Tensor | None, weight: float = 1.0
                              ) -> torch.Tensor:
        """Keep the part (the parent's waiting and banning rules), return the ordered mean."""
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future,
                                asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException("attempted to aggregate part in a finalized reducer")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        future = self.current_part_future
        self.parts[sender_index] = (tensor_part, weight)
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        return await future

    def check_current_part_finished(self) -> None:
        """All current senders in: the mean in the fixed order, then the next part."""
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        owner = self.owners[self.current_part_index]
        order = [owner] + sorted(i for i in self.parts if i != owner)
        # every weighted part is checked before it counts (size, finite, norm bound; an
        # excluded sender's is left out unread); one left out is named by the host
        # (HivemindOuter._note_rejected), the round goes on
        weighted = {i: t for i, (t, w) in self.parts.items() if w > 0}
        numel = self.part_shapes[self.current_part_index].numel()
        faults = screened(weighted, numel, self.me, self.excluded)
        for i, why in faults.items():
            self.rejected.setdefault(i, why)
        used = [weighted[i] for i in order if i in weighted and i not in faults]
        if not used:  # only weight-0 senders: nothing to average (never committed)
            self.current_part_future.set_exception(AllreduceException("no weighted sender"))
        else:
            acc = used[0].to(torch.float32).clone()
            for t in used[1:]:
                acc += t
            self.current_part_future.set_result(ieee_div(acc, len(used)))
        self.reset_accumulators()


class ExactRunner(AllReduceRunner):
    """AllReduceRunner with OrderedReducer, our wire codec and the mean itself (not a delta)
    sent back; `failed` says whether any sender or reducer was lost."""

    def __init__(self, *, wire: CodecWire, owners: list[int], fail_fast: bool = False,
                 suspects: set[str] | None = None, excluded: frozenset[str] = frozenset(),
                 **kwargs: Any) -> None:
        super().__init__(compression=wire, part_size_bytes=WHOLE_PARTS, **kwargs)
        self.wire, self.fail_fast = wire, fail_fast
        self.part_numels = [[part.numel() for part, _ in parts] for parts in
                            self.tensor_part_container._input_parts_by_peer]
        """Per peer, the size of each mean it sends back (checked before it is used)."""
        self.own_norms = [[norm_of(part) if self.weight > 0 else None for part, _ in parts]
                          for parts in self.tensor_part_container._input_parts_by_peer]
        """Per peer, the norm of my part of each of its chunks (a mean's bound)."""
        self.suspects = suspects if suspects is not None else set()
        """Peers (base58) whose contribution or mean was refused: never a state source."""
        replaced = self.tensor_part_reducer
        replaced.num_senders = 0  # never used: no "received 0%" warning when it is dropped
        replaced.finalize()
        self.tensor_part_reducer = OrderedReducer(
            tuple(p.shape for p in self.parts_for_local_averaging), len(self.sender_peer_ids),
            owners, wire, me=self.sender_peer_ids.index(self.peer_id)
            if self.peer_id in self.sender_peer_ids and self.weight > 0 else None,
            excluded={i for i, p in enumerate(self.sender_peer_ids)
                      if str(p) in excluded and p != self.peer_id})

    @property
    def failed(self) -> bool:
        """A sender was banned or a reducer's parts fell back to local values."""
        return bool(self.banned_senders) or self.tensor_part_container.failed_size > 0

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """My own chunk: reduce it, keep what the others decode; a peer's: read its means."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender = self.sender_peer_ids.index(peer_id)
            for i, part in enumerate(self.parts_for_local_averaging):
                mine = self.wire.roundtrip(part)  # the store's owner decodes its own encoding
                mean = await self.tensor_part_reducer.accumulate_part(sender, i, mine,
                                                                      weight=self.weight)
                self.tensor_part_container.register_processed_part(
                    peer_index, i, self.wire.roundtrip(mean))
            return
        try:
            await self._read_means(peer_id, peer_index)
        except BaseException as e:
            self.tensor_part_container.register_failed_reducer(peer_index)
            if self.fail_fast and isinstance(e, Exception):
                # the round is lost: end it now rather than wait out the senders' timeout
                # for the parts a dead member will never send (its roster entry outlives it)
                self.finalize(exception=AllreduceException(f"peer {peer_id} failed: {e!r}"))
            raise

    async def _read_means(self, peer_id: PeerID, peer_index: int) -> None:
        """Send my parts for `peer_id`'s chunk, register the means it sends back."""
        stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(
            self._generate_input_for_peer(peer_index))

        def decode(msg: averaging_pb2.AveragingData) -> torch.Tensor:
            if msg.code != averaging_pb2.AVERAGED_PART:
                raise AllreduceException(f"{peer_id} sent "
                                         f"{averaging_pb2.MessageCode.Name(msg.code)}")
            return self.wire.extract(msg.tensor_part)

        count = 0
        parts = self.tensor_part_container.num_parts_by_peer[peer_index]
        async for mean in amap_in_executor(decode, aiter_with_timeout(stream,
                                                                      self.reducer_timeout)):
            fault = (mean_fault(mean, self.part_numels[peer_index][count],
                                self.own_norms[peer_index][count]) if count < parts
                     else "more parts than its chunk has")
            if fault is not None:  # the reducer's mean itself is bad: the round fails here
                self.suspects.add(str(peer_id))
                raise AllreduceException(f"peer {peer_id} sent a mean with {fault}")
            self.tensor_part_container.register_processed_part(peer_index, count, mean)
            count += 1
        if count != self.tensor_part_container.num_parts_by_peer[peer_index]:
            raise AllreduceException(f"peer {peer_id} sent {count} parts, expected "
                                     f"{self.tensor_part_container.num_parts_by_peer[peer_index]}")

    def _decode_part(self, msg: averaging_pb2.AveragingData) -> tuple[torch.Tensor | None, float]:
        """A sender's part and weight; None for a part that does not decode (cut, garbage):
        the reducer leaves it out by name instead of the stream failing."""
        try:
            return self.wire.extract(msg.tensor_part), float(msg.weight)
        except Exception:  # noqa: BLE001 - whatever the bytes were, they are no part
            return None, float(msg.weight)

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int
                                          ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A sender's parts of my chunk in, the encoded means out."""
        part_index = 0
        loop = asyncio.get_event_loop()
        try:
            async for part, weight in amap_in_executor(self._decode_part, stream):
                try:
                    mean = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=weight)
                except BannedException:
                    break
                part_index += 1
                encoded = await loop.run_in_executor(None, self.wire.compress, mean)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART,
                                                  tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class ExactAverager(ExclusionMixin, DecentralizedAverager):
    """DecentralizedAverager (hivemind's matchmaking, DHT, state sharing) running ExactRunner.

    `step(gather={"replica": r})` is required: peers are ordered by it. `state_fn` returns
    what a peer loading state from this one gets: (metadata, tensors). `proof`: the run's
    membership proofs; a group with a peer whose gather does not carry a valid one
    ({"proof": ...}) fails before any data moves (None: no check, tests of the averager)."""

    def __init__(self, tensors: Sequence[torch.Tensor], dht: Any, *, wire: CodecWire,
                 state_fn: Callable[[], tuple[dict, list[torch.Tensor]]] | None = None,
                 proof: PeerProof | None = None, **kwargs: Any) -> None:
        self.wire = wire
        self.state_fn = state_fn
        self.proof = proof
        self._suspects: set[str] = set()
        """(averager process) Peers whose contribution or mean a round refused (base58)."""
        super().__init__(tensors, dht, **kwargs)

    def run(self) -> None:
        """(the averager process) hivemind's loop until shutdown, then hand over the file
        descriptors still offered to the DHT process before exiting (dht.hand_over_fds)."""
        super().run()
        hand_over_fds()

    async def _shutdown(self, timeout: float | None) -> None:
        """(the averager process) hivemind's shutdown, which in 1.1.12 called `finalize` on
        each running group's Future rather than on its runner (and gathered what `finalize`
        returns, None): an AttributeError traceback whenever a replica stopped with a round
        registered (seen on Ctrl+C while a round waited for a frozen peer). Each runner is
        cancelled now, and a group still forming is cancelled as a Future."""
        if not self.client_mode:
            await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
        for future in list(self._running_groups.values()):
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)
            else:
                future.cancel()

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[Any]]:
        """The state a loading peer receives (the host process's latest snapshot)."""
        if self.state_fn is None:
            return {}, [], []
        meta, tensors = self.state_fn()
        return meta, tensors, [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]

    def load_checked_state(self, check: dict, peers: list[str], timeout: float
                           ) -> tuple[Any, list[torch.Tensor], list[tuple[str, str]]]:
        """The shared state of the most advanced of `peers` (base58, the run's roster) whose
        state passes hivemind_checks.state_fault(**check): (metadata, tensors, the peers
        refused and why); metadata None when none passed. hivemind's load_state_from_peers
        stops at the first peer that answers, an outsider's or a poisoned one included."""
        from hivemind.utils.mpfuture import MPFuture

        future = MPFuture()
        self._outer_pipe.send(("_load_checked_state", [], dict(
            check=check, peers=peers, timeout=timeout, future=future)))
        return future.result(timeout=STATE_SOURCES * timeout + 1.0)

    async def _load_checked_state(self, check: dict, peers: list[str], timeout: float,
                                  future: Any) -> None:
        """(averager process) `load_checked_state`: at most STATE_SOURCES peers by declared
        priority, each download within `timeout`."""
        refused: list[tuple[str, str]] = []
        try:
            found = self.dht.get(f"{self.prefix}.all_averagers", latest=True)
            declared = found.value if found is not None and isinstance(found.value, dict) else {}
            prio = {}
            for peer in peers:
                v = declared.get(PeerID.from_base58(peer).to_bytes())
                value = getattr(v, "value", None)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    prio[peer] = float(value)
            for peer in [p for p in prio if p in self._suspects]:
                refused.append((peer, "it sent a refused contribution or mean to a round here"))
            trusted = [p for p in prio if p not in self._suspects]
            for peer in sorted(trusted, key=prio.get, reverse=True)[:STATE_SOURCES]:
                try:
                    meta, tensors = await asyncio.wait_for(
                        self._download(peer, STATE_BYTES_PER_VALUE * check["numel"] + (1 << 20)),
                        timeout)
                except Exception as e:  # noqa: BLE001 - a dead, slow or garbled peer
                    refused.append((peer, f"no complete state within {timeout:.2f} s "
                                          f"({type(e).__name__})"))
                    continue
                fault = state_fault(meta, tensors, **check)
                if fault is None:
                    future.set_result((meta, tensors, refused))
                    return
                refused.append((peer, fault))
        finally:
            if not future.done():
                future.set_result((None, [], refused))

    async def _download(self, peer: str, limit: int) -> tuple[Any, list[torch.Tensor]]:
        """(averager process) A peer's shared state as it streams it (hivemind's format);
        ValueError past `limit` bytes (a peer that streams without end is refused, not kept)."""
        stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        meta, tensors, current, size = None, [], [], 0
        async for message in stream:
            size += len(message.tensor_part.buffer) + len(message.metadata)
            if size > limit:
                raise ValueError(f"more than {limit} bytes")
            if message.metadata:
                meta = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and current:  # a new tensor starts
                tensors.append(deserialize_torch_tensor(combine_from_streaming(current)))
                current = []
            current.append(message.tensor_part)
        if current:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(current)))
        return meta, tensors

    async def _set_group_size(self, size: int, minimum: int, future: Any) -> None:
        """(averager process) Form a group as soon as `size` peers are in it, and at the
        matchmaking deadline only with at least `minimum` (hivemind's leader checks it)."""
        mm = self._matchmaking
        mm.target_group_size, mm.min_group_size = size, minimum
        mm.group_key_manager.target_group_size = size
        mm.potential_leaders.target_group_size = size
        future.set_result(None)

    async def _set_deadlines(self, matchmaking_s: float, averaging_s: float, request_s: float,
                             future: Any) -> None:
        """(averager process) The next attempts' deadlines (modules.sync.outer_deadlines:
        widened after a failed attempt, narrowed back after rounds well within them)."""
        mm = self._matchmaking
        mm.min_matchmaking_time = mm.potential_leaders.min_matchmaking_time = matchmaking_s
        mm.request_timeout = request_s
        self.matchmaking_kwargs.update(min_matchmaking_time=matchmaking_s,
                                       request_timeout=request_s)
        self.allreduce_kwargs.update(sender_timeout=averaging_s / 2, reducer_timeout=averaging_s)
        self._allreduce_timeout = self.next_chunk_timeout = averaging_s
        future.set_result(None)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int,
                                    **kwargs: Any) -> dict:
        """Order the group by replica and run ExactRunner; the result is written only when the
        whole round succeeded."""
        loads = self.serializer.loads
        unpacked = [loads(g) for g in group_info.gathered]  # [bandwidth, mode, user data]
        by_peer = {p: loads(u[2]) for p, u in zip(group_info.peer_ids, unpacked)}
        self._refuse_strangers(by_peer, self._running_groups.get(group_info.group_id))
        client = {p for p, u in zip(group_info.peer_ids, unpacked)
                  if u[1] == AveragingMode.CLIENT.value}
        order = sorted(group_info.peer_ids, key=lambda p: (by_peer[p]["replica"], p.to_bytes()))
        async with enter_asynchronously(self.get_tensors()) as local:
            flat = local[0]
            out = flat.clone()
            views, sizes, owners = owner_views(out, len(order), self.wire.block,
                                               clients={j for j, p in enumerate(order)
                                                        if p in client})
            runner = ExactRunner(
                p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=views,
                group_id=group_info.group_id, ordered_peer_ids=order, peer_fractions=sizes,
                weight=kwargs["weight"], sender_timeout=kwargs.get("sender_timeout"),
                reducer_timeout=kwargs.get("reducer_timeout"), wire=self.wire,
                owners=owners[order.index(self.peer_id)],
                fail_fast=kwargs.get("fail_fast", False), suspects=self._suspects,
                excluded=self._excluded)
            self._running_groups[group_info.group_id].set_result(runner)
            results = []
            async for result in runner:
                results.append(result)
            for i, why in runner.tensor_part_reducer.rejected.items():
                peer = runner.sender_peer_ids[i]
                by_peer[peer] = {**by_peer[peer], "rejected": why, "peer": str(peer)}
                self._suspects.add(str(peer))
            if runner.failed or len(results) != len(views):
                raise AllreduceException("a peer left the round mid-way")
            for view, result in zip(views, results):
                view.copy_(result.reshape(view.shape))
            flat.copy_(out)
            self.last_updated = get_dht_time()
            self._state_updated.set()
        return {p: by_peer[p] for p in group_info.peer_ids}

    def _refuse_strangers(self, by_peer: dict, running: asyncio.Future | None = None) -> None:
        """(averager process) AllreduceException before any data moves, a suspect named
        (never a source of state here), when a peer's gather proves no membership; `running`
        (the group's registration) fails too: parts waiting on it end now, not at a timeout."""
        gathered = {p.to_base58(): data for p, data in by_peer.items()}
        stranger = self.proof and self.proof.stranger(gathered, self.peer_id.to_base58())
        if stranger:
            self._suspects.add(stranger)
            e = AllreduceException(f"peer {stranger} of the group is {NOT_A_MEMBER}; the "
                                   "round is not averaged with it")
            if running is not None and not running.done():
                running.set_exception(e)
            raise e

    _fixed_wait_s: float = 5.0
    """How long a part for a group formed from the roster waits for its receiver to reach
    that round (set by `_fixed_round`; the replicas' skew at the round's start)."""
    _round_reached: int = -1
    """The last round this peer started an attempt at, or passed by loading a peer's state
    (`_fixed_round`, `_reach_round`): a roster group's part for a round up to it that is not
    registered here never will be."""

    async def _reach_round(self, index: int) -> None:
        """(averager process) This peer is at round `index` or past it (`_round_reached`)."""
        self._round_reached = max(self._round_reached, index)

    async def _fixed_round(self, index: int, group_id: bytes,
                           members: list[tuple[str, int, bool]], weight: float, wait_s: float,
                           future: Any) -> None:
        """(averager process) Average round `index` in the group `members` ((peer id, replica,
        client mode), the same list and `group_id` on every member: formed from the roster,
        no matchmaking); `future` gets the members' gathered data, or the failure. The
        all-reduce's waits include `wait_s`, the skew allowed between members' starts; it
        ends at the first member that fails (ExactRunner's fail_fast: the roster may still
        name a replica that died, and the round then goes to matchmaking at once)."""
        try:
            dumps = self.serializer.dumps
            modes = {True: AveragingMode.CLIENT.value, False: AveragingMode.NODE.value}
            info = GroupInfo(group_id, tuple(PeerID.from_base58(p) for p, _, _ in members),
                             tuple(dumps([None, modes[c], dumps(self._gathered_of(p, r))])
                                   for p, r, c in members))
            self._fixed_wait_s = wait_s
            await self._reach_round(index)
            kwargs = dict(self.allreduce_kwargs, fail_fast=True)
            for key in ("sender_timeout", "reducer_timeout"):
                if kwargs.get(key) is not None:
                    kwargs[key] += wait_s
            limit = self._allreduce_timeout
            with self._register_allreduce_group(info):
                gathered = await asyncio.wait_for(
                    self._aggregate_with_group(info, tensor_infos=self.tensor_infos,
                                               weight=weight, **kwargs),
                    timeout=None if limit is None else limit + wait_s)
            future.set_result(gathered)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            if not future.done():
                future.set_exception(e if isinstance(e, Exception)
                                     else AllreduceException(repr(e)))
            if not isinstance(e, Exception):
                raise

    def _gathered_of(self, peer: str, replica: int) -> dict:
        """What `peer` (of a group formed from the roster, whose entries' proofs held) would
        have gathered in matchmaking."""
        return {"replica": replica, **({"proof": self.proof.of(peer)} if self.proof else {})}

    async def rpc_aggregate_part(self, stream: Stream[averaging_pb2.AveragingData],
                                 context: P2PContext) -> Stream[averaging_pb2.AveragingData]:
        """hivemind's handler, except that a part for a group formed from the roster waits
        (up to `_fixed_wait_s`) for this peer to register that very group: hivemind's waits
        on one event that any group's registration or end sets, so a part for the next
        group passed as soon as the running one ended, and was refused (BAD_GROUP_ID). It
        is refused at once when this peer reached that round otherwise (another roster
        group: the members read different rosters; matchmaking; a later round) or passed it
        (`_round_reached`), so that the sender's round goes to matchmaking without waiting."""
        request = await anext(stream)
        if request.group_id.startswith(FIXED_GROUP):
            index = fixed_group_round(request.group_id)
            until = asyncio.get_event_loop().time() + self._fixed_wait_s
            while (request.group_id not in self._running_groups
                   and self._round_reached < index
                   and asyncio.get_event_loop().time() < until):
                await asyncio.sleep(0.005)
        elif request.group_id not in self._running_groups:
            await self._pending_groups_registered.wait()
        future = self._running_groups.get(request.group_id)
        if future is None:
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
            return
        group = await future
        async for message in group.rpc_aggregate_part(achain(as_aiter(request), stream),
                                                      context):
            yield message
