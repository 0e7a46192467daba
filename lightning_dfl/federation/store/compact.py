"""The compact client store (``FederatedTrainer(store="compact")``): active values plus packed mask bits.

:class:`~lightning_dfl.federation.store.dense.DenseClientStore` keeps, per node, two dense slots of every weight
and two bool published masks plus a bool current mask: 100 CIFAR ResNet18 clients take 11.44 GiB.
:class:`CompactClientStore` has the same API and gives bit-identical results, but keeps

* each node's published model as a *record* (the codec: :mod:`~lightning_dfl.federation.store.records`): for a masked parameter its values at the published mask's
  active positions (flattened order) and the mask packed 8 bits a byte; the sign of the zeros outside
  the mask, 1 bit per inactive entry, only when one of them is ``-0.0`` (the engine zeroes pruned
  weights with :func:`~lightning_dfl.sparse.masks.zero_inactive_`, which leaves ``+0.0``; a bare
  ``p.mul_(mask)`` in a user's hook leaves ``-0.0``); the whole tensor when an entry outside the mask is not
  a zero (a server's model, a callback that changed the mask without zeroing), so nothing is ever
  lost; unmasked tensors (biases, norm layers) dense. Records are immutable and never copied: a
  node's current mask shares its published mask's bytes when they are equal.
* one record per node (its start-of-round model) plus the records published in this round, instead
  of two slots per node: the round's end replaces the start-of-round records of the nodes that wrote
  and frees the old ones. Between rounds the store holds one record per node; within a round a node
  that published holds two while a task still to run may read its start-of-round model. For an
  algorithm whose tasks read only their plan's sources
  (:attr:`~lightning_dfl.federation.algorithms.base.Algorithm.reads_only_sources`) the executor frees
  the old record after its last reader (:meth:`~CompactClientStore.release_start`); reading it
  afterwards raises.
* the declared fields (:class:`~lightning_dfl.federation.store.fields.StateField`) as the dense store does
  (both keep them in :class:`~lightning_dfl.federation.store.protocol.ClientStore`), two slots for published ones: :meth:`~CompactClientStore.read` returns views that callers write in
  place (the executor's kept optimizer state, ``trainer.client_state(k)``).

:meth:`~CompactClientStore.published`, :meth:`~CompactClientStore.gather` and
:meth:`~CompactClientStore.mask` return dense tensors rebuilt on demand (zeros, the values scattered
where the unpacked mask is set); they are read-only like the dense store's views: a write into them is
lost (the engine and its algorithms never write into them). Checkpoints hold the records as they are
(``state_dict()["format"] == "compact"``); either store loads the other's checkpoints.

Devices are handled as in the dense store (the records and fields on ``store.device``, whatever device
the tensors given come from; a ``state_dict`` of CPU tensors), except that a pinned store
(``pin_memory``) pins only its fields: the records are built by numpy and sized by their masks, and pinning
each would cost one more copy and, through the host allocator's power-of-two blocks, up to twice the memory
this store exists to save.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dfl.allocator import release_heap
from lightning_dfl.deferred import host_reads_are_cheap
from lightning_dfl.federation.store.fields import StateField
from lightning_dfl.federation.store.protocol import ClientStore, gather_published
from lightning_dfl.federation.store.records import (
    BIT_ORDER,
    FORMAT,
    INT_VIEWS,
    bit_range,
    check_compact_state,
    pack_bits_all,
    scatter_,
    select,
    select_all,
    share_equal_parts,
    signed_zeros,
    unpack_bits_together,
)
from lightning_dfl.federation.store.saved_state import StoreLayout
from lightning_dfl.sparse.bits import pack_bits, unpack_bits
from lightning_dfl.sparse.masks import Masks, sums_by_part, zero_inactive_all_
from lightning_dfl.transfers import copy_all_

__all__ = ["TRIM_EVERY_BYTES", "CompactClientStore"]


# -- memory -------------------------------------------------------------------------------------------


def _storages(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


#: bytes of temporaries (dense copies, bool masks) after which the heap is trimmed (:func:`release_heap`)
TRIM_EVERY_BYTES = 1 << 27


# -- the store --------------------------------------------------------------------------------------


class CompactClientStore(ClientStore):
    """:class:`~lightning_dfl.federation.store.protocol.ClientStore` over compact records (see the module
    docstring); its arguments (``pin_memory`` pins the fields only)."""

    def __init__(self, template: Mapping[str, Tensor], masked_names: list[str], num_nodes: int,
                 device: torch.device | str = "cpu", fields: Iterable[StateField] = (),
                 pin_memory: bool = False) -> None:
        super().__init__(template, masked_names, num_nodes, device, fields, pin_memory)
        self._masked = set(masked_names)
        self.shapes = {n: tuple(t.shape) for n, t in template.items()}
        self.dtypes = {n: t.dtype for n, t in template.items()}
        self.numels = {n: t.numel() for n, t in template.items()}
        self.unmasked_size = sum(t.numel() for n, t in template.items() if n not in self._masked)
        # before initialize(): zero weights, all-true masks and no active values, as the dense store
        blank = {"values": {n: torch.zeros(self.numels[n], dtype=self.dtypes[n], device=self.device)
                            for n in self.names},
                 "bits": {n: pack_bits(torch.ones(self.numels[n], dtype=torch.bool, device=self.device), BIT_ORDER)
                          for n in self.masked_names},
                 "neg": {}, "active": 0}
        # start of round (shared: immutable; None once freed after its last reader in the round)
        self.records: list[dict[str, Any] | None] = [blank] * num_nodes
        self.fresh_records: dict[int, dict[str, Any]] = {}  # published in this round
        self._incoming: dict[int, tuple[dict[str, Tensor], ...]] = {}  # task_views' buffers (sharding)
        self._churn = 0  # bytes of temporaries since the heap was last trimmed (release_heap)
        self.current_bits: list[dict[str, Tensor]] = [blank["bits"]] * num_nodes  # the masks trained with next

    # -- records ------------------------------------------------------------------------
    def _copies(self, values: Mapping[str, Tensor | float | bool], names: list[str],
                dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """``values[n]`` (on any device) for each of ``names`` as the dense store's ``copy_`` into its slot would
        leave it (the store's dtype, or ``dtype``; the store's device; the parameter's shape), flattened; new
        tensors (:func:`~lightning_dfl.transfers.copy_all_`: those from the store's device in one multi-tensor
        copy)."""
        outs = {n: torch.empty(self.shapes[n], dtype=dtype or self.dtypes[n], device=self.device) for n in names}
        copy_all_((outs[n], values[n]) for n in names if isinstance(values[n], Tensor))
        for n in names:
            if not isinstance(values[n], Tensor):  # a number for the whole tensor
                outs[n].fill_(values[n])
        return {n: out.reshape(-1) for n, out in outs.items()}

    def _all_masks(self, mask: Mapping[str, Tensor] | None) -> dict[str, Tensor]:
        """:meth:`_copies` of a mask as bool (``None``: every weight active)."""
        return self._copies(mask if mask is not None else dict.fromkeys(self.masked_names, True), self.masked_names,
                            torch.bool)

    def _record(self, weights: Mapping[str, Tensor], masks: Mapping[str, Tensor],
                active: int | None = None) -> dict[str, Any]:
        """A record of dense ``weights`` (flat, the store's dtypes, owned) and flat bool ``masks``; ``active``
        defaults to the values the masks keep. One host read for all parameters: each mask's count and whether
        a nonzero bit lies outside it (a value, or a ``-0.0``); only such a rare parameter reads more."""
        masked = self.masked_names
        counts: list[int] = []
        outside: list[int] = []
        if masked:
            counts, outside = self._checks(weights, masks)
        found = dict(zip(masked, zip(counts, outside)))
        values: dict[str, Tensor] = {}
        bits: dict[str, Tensor] = {}
        neg: dict[str, Tensor] = {}
        packed = pack_bits_all({n: masks[n] for n in masked})
        # plain +0.0 everywhere outside the mask (the common case): the active values, selected together
        plain = [n for n in masked if found[n][0] != self.numels[n] and not found[n][1]]
        selected = dict(zip(plain, select_all([weights[n] for n in plain], [masks[n] for n in plain],
                                              [found[n][0] for n in plain])))
        for n in self.names:
            w = weights[n]
            if n not in self._masked:
                values[n] = w
                continue
            m = masks[n]
            bits[n] = packed[n]
            count, leaks = found[n]
            if count == w.numel():
                values[n] = w
                continue
            if not leaks:
                values[n] = selected[n]
                continue
            off = select(w, ~m)
            if bool(off.ne(0).any()):  # a value outside the mask: keep the tensor whole
                values[n] = w
                continue
            values[n] = select(w, m, count)
            sign = off.signbit()
            if bool(sign.any()):
                neg[n] = pack_bits(sign, BIT_ORDER)
        self._churn += sum(3 * t.numel() * t.element_size() for t in weights.values())
        if self._churn > TRIM_EVERY_BYTES and self.device.type == "cpu":
            self._churn = 0
            release_heap()
        if active is None:
            active = self.unmasked_size + sum(counts)
        return {"values": values, "bits": bits, "neg": neg, "active": int(active)}

    def _checks(self, weights: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> tuple[list[int], list[int]]:
        """Per masked parameter, its mask's count and whether a nonzero bit lies outside it (a value, or a
        ``-0.0``), read at once; on an accelerator for parameters of one item size in a few kernels for all."""
        masked = self.masked_names
        views = [weights[n].view(INT_VIEWS[weights[n].element_size()]) for n in masked]
        if host_reads_are_cheap(self.device) or len({v.dtype for v in views}) > 1 \
                or any(self.numels[n] == 0 for n in masked):
            checks = [masks[n].sum() for n in masked]
            checks += [v.ne(0).logical_and_(~masks[n]).any() for n, v in zip(masked, views)]
            read = torch.stack([c.to(torch.long) for c in checks]).tolist()
            return read[:len(masked)], read[len(masked):]
        flat = torch.cat([masks[n] for n in masked])
        flags = torch.stack([flat, torch.cat(views).ne(0).logical_and_(~flat)])
        counts, outside = sums_by_part(flags, [self.numels[n] for n in masked]).tolist()
        return counts, [int(bool(o)) for o in outside]

    def _dense(self, record: Mapping[str, Any], name: str, mask: Tensor | None = None) -> Tensor:
        """The dense tensor ``name`` of a record (a view of a dense-kept one; else rebuilt)."""
        values, numel = record["values"][name], self.numels[name]
        if values.numel() == numel:
            return values.view(self.shapes[name])
        if mask is None:
            mask = unpack_bits(record["bits"][name], numel, BIT_ORDER)
        out = scatter_(torch.zeros(numel, dtype=values.dtype, device=values.device), mask, values)
        neg = record["neg"].get(name)
        if neg is not None:
            scatter_(out, ~mask, signed_zeros(unpack_bits(neg, numel - values.numel(), BIT_ORDER), values.dtype))
        return out.view(self.shapes[name])

    def _expand(self, record: Mapping[str, Any]) -> tuple[dict[str, Tensor], Masks]:
        """A record's dense weights and masks. On an accelerator every mask is unpacked at once (the packed bits
        concatenated) and the masked parameters that keep their active values only (the common case) are rebuilt
        together, per dtype: their values scattered into one buffer, each tensor a view of it (a dozen kernels per
        model, not several per parameter). The other parameters, and all on a CPU (where the concatenation would
        only add copies: 65 vs 75-100 ms per ResNet18 model), one by one (:meth:`_dense`)."""
        masks: dict[str, Tensor] = {}
        weights: dict[str, Tensor] = {}
        if not host_reads_are_cheap(self.device) and self.masked_names:
            groups: dict[torch.dtype, list[str]] = {}
            for n in self.masked_names:
                values = record["values"][n]
                if values.numel() != self.numels[n] and n not in record["neg"]:
                    groups.setdefault(values.dtype, []).append(n)
            grouped = [n for names in groups.values() for n in names]
            kept = set(grouped)
            order = grouped + [n for n in self.masked_names if n not in kept]  # each group contiguous
            bits, offsets = unpack_bits_together(record["bits"], order)
            for n in order:
                masks[n] = bits[offsets[n]:offsets[n] + self.numels[n]]
            for dtype, names in groups.items():
                lo = offsets[names[0]]
                hi = offsets[names[-1]] + 8 * record["bits"][names[-1]].numel()
                dense = scatter_(torch.zeros(hi - lo, dtype=dtype, device=bits.device), bits[lo:hi],
                                 torch.cat([record["values"][n] for n in names]))
                for n in names:
                    weights[n] = dense[offsets[n] - lo:offsets[n] - lo + self.numels[n]].view(self.shapes[n])
        for n in self.masked_names:
            if n not in masks:
                masks[n] = unpack_bits(record["bits"][n], self.numels[n], BIT_ORDER)
        for n in self.names:
            if n not in weights:
                weights[n] = self._dense(record, n, masks.get(n))
        return ({n: weights[n] for n in self.names},
                {n: masks[n].view(self.shapes[n]) for n in self.masked_names})

    def _latest(self, node: int, fresh: bool) -> dict[str, Any]:
        self._slot(node, fresh)  # raises for a fresh read of a node that has not published
        return self.fresh_records[node] if fresh else self._start(node)

    def _start(self, node: int) -> dict[str, Any]:
        record = self.records[node]
        if record is None:
            raise RuntimeError(
                f"node {node}'s start-of-round model was read after it was freed: the compact store frees it "
                "once the node has published and every task of the round's plan that lists it as a source has "
                "run (the algorithm's reads_only_sources is True). Read start-of-round models of other nodes "
                "only as a task's sources, or set reads_only_sources = False on the algorithm")
        return record

    def release_start(self, node: int) -> None:
        """Free ``node``'s start-of-round record if it has published this round (see the module docstring)."""
        if node in self.fresh_records:
            self.records[node] = None

    # -- the round ----------------------------------------------------------------------
    def _commit_round(self) -> None:
        """This round's published records become the start-of-round ones (the replaced records are freed)."""
        for node, record in self.fresh_records.items():
            self.records[node] = record
        self.fresh_records.clear()
        if self.device.type == "cpu":  # the replaced records' pages
            self._churn = 0
            release_heap()

    # -- writes -------------------------------------------------------------------------
    @torch.no_grad()
    def initialize(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None) -> None:
        """Set a node's current model and mask before the first round (as the dense store: the weights
        times the mask)."""
        dense = self._copies(weights, self.names)
        masks = self._all_masks(mask)  # on the store's device
        zero_inactive_all_([dense[n] for n in self.masked_names], [masks[n] for n in self.masked_names])
        record = self._record(dense, masks)
        self.records[node] = record
        self.current_bits[node] = record["bits"]

    @torch.no_grad()
    def publish(self, node: int, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None,
                fields: Mapping[str, Tensor | float | Mapping[str, Tensor]] | None = None) -> None:
        """Write the model ``node`` publishes in this round (weights and the mask trained with) and
        its published fields (those not given keep their start-of-round value)."""
        fields = self._check_publish(node, fields)
        dense = self._copies(weights, self.names)
        masks = self._all_masks(mask)
        record = self._record(dense, masks)
        record["bits"] = share_equal_parts(self.current_bits[node], record["bits"])
        self.fresh_records[node] = record
        self._publish_fields(node, fields)

    @torch.no_grad()
    def set_mask(self, node: int, mask: Mapping[str, Tensor]) -> None:
        """Set the mask ``node`` trains with next."""
        self.current_bits[node] = self._share(node, pack_bits_all(self._all_masks(mask)))

    def _share(self, node: int, bits: dict[str, Tensor]) -> dict[str, Tensor]:
        """``bits`` (a current mask), each part replaced by the node's latest published one when equal."""
        return share_equal_parts((self.fresh_records[node] if node in self.fresh_records else self._start(node))["bits"], bits)

    # -- processes sharing a federation (sharding) --------------------------------------
    def task_views(self, node: int) -> list[Tensor]:
        """:meth:`~lightning_dfl.federation.store.protocol.ClientStore.task_views` as dense buffers: the owner's
        are rebuilt from what its task published (read for the broadcast); another process gets empty buffers,
        filled by the broadcast and compressed by :meth:`mark_published`. Fields are the store's own views."""
        if node in self._written:
            weights, masks = self.published(node, fresh=True)
            current = self.mask(node)
            active = torch.tensor([self.fresh_records[node]["active"]], dtype=torch.long, device=self.device)
        else:
            weights = {n: torch.empty(self.shapes[n], dtype=self.dtypes[n], device=self.device) for n in self.names}
            masks = {n: torch.empty(self.shapes[n], dtype=torch.bool, device=self.device) for n in self.masked_names}
            current = {n: torch.empty(self.shapes[n], dtype=torch.bool, device=self.device) for n in self.masked_names}
            active = torch.zeros(1, dtype=torch.long, device=self.device)
            self._incoming[node] = (weights, masks, current, active)
        views = [weights[n] for n in self.names]
        views += [masks[n] for n in self.masked_names]
        views += [active, *(current[n] for n in self.masked_names)]
        return views + self._field_views(node)

    @torch.no_grad()
    def mark_published(self, node: int) -> None:
        """Record that ``node`` published this round: its :meth:`task_views` buffers, filled from another
        process, become its record and its current mask."""
        incoming = self._incoming.pop(node, None)
        if incoming is not None:
            weights, masks, current, active = incoming
            record = self._record({n: weights[n].reshape(-1) for n in self.names},
                                  {n: masks[n].reshape(-1) for n in self.masked_names}, int(active[0]))
            self.fresh_records[node] = record
            self.current_bits[node] = self._share(node, pack_bits_all({n: current[n] for n in self.masked_names}))
        self._written.add(node)

    # -- many nodes read in column blocks ------------------------------------------------
    def column_blocks(self, nodes: Sequence[int], name: str, mask: bool, step: int) -> Iterator[tuple[int, Tensor]]:
        """:meth:`ClientStore.column_blocks <lightning_dfl.federation.store.protocol.ClientStore.column_blocks>`: the
        blocks decoded from the nodes' current records (:meth:`_column_block`), never a node's whole model. The
        records are looked up once per call, not once per block."""
        records = [self._start(k) for k in nodes]  # the current published models: the start-of-round records
        prefix = [0] * len(records)  # active values before the block, per record (blocks are read in order)
        numel = self.numels[name]
        for start in range(0, numel, step):
            yield start, self._column_block(records, prefix, name, mask, start, min(start + step, numel))

    def _column_block(self, records: list[dict[str, Any]], prefix: list[int], name: str, mask: bool, start: int,
                      stop: int) -> Tensor:
        """Entries ``[start, stop)`` of ``name`` (flattened) in each record, stacked ``(len(records), stop -
        start)``: the mask bits of all records unpacked at once, one read of their counts, the active values
        scattered in one step. ``prefix[i]``: record ``i``'s active values before ``start`` (updated to
        ``stop``)."""
        width = stop - start
        dtype = torch.bool if mask else self.dtypes[name]
        if not records:
            return torch.zeros((0, width), dtype=dtype, device=self.device)
        if name not in self._masked:
            return torch.stack([rec["values"][name][start:stop] for rec in records])
        first, last = start // 8, (stop + 7) // 8  # the bytes holding the block's bits
        packed = torch.stack([rec["bits"][name][first:last] for rec in records])
        if host_reads_are_cheap(packed.device):
            bits = torch.from_numpy(np.unpackbits(packed.numpy(), axis=1, count=stop - 8 * first, bitorder="little"))
        else:
            shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
            bits = ((packed.unsqueeze(2) >> shifts) & 1).reshape(len(records), -1)[:, :stop - 8 * first]
        bits = bits[:, start - 8 * first:].contiguous().view(torch.bool)
        if mask:
            return bits
        counts = bits.sum(dim=1).tolist()  # the one read of the block
        out = torch.zeros((len(records), width), dtype=dtype, device=self.device)
        sparse, chunks = [], []
        for i, rec in enumerate(records):
            values = rec["values"][name]
            before, prefix[i] = prefix[i], prefix[i] + counts[i]
            if values.numel() == self.numels[name]:
                out[i] = values[start:stop]
            elif name in rec["neg"]:  # -0.0 outside the mask (rare): that row's zeros get their signs
                neg = rec["neg"][name]
                row = scatter_(out[i], bits[i], values[before:before + counts[i]])
                inactive = start - before
                scatter_(row, ~bits[i], signed_zeros(bit_range(neg, inactive, inactive + width - counts[i]),
                                                     values.dtype))
            else:
                sparse.append(i)
                chunks.append(values[before:before + counts[i]])
        if sparse:
            index = torch.tensor(sparse, device=out.device)
            block = torch.zeros((len(sparse), width), dtype=dtype, device=out.device)
            scatter_(block.view(-1), bits.index_select(0, index).view(-1), torch.cat(chunks))
            out.index_copy_(0, index, block)
        return out

    def packed_published_masks(self, nodes: Sequence[int]) -> Tensor:
        """The nodes' current published masks as ``(len(nodes), words)`` int64 rows: each record's packed
        bits, names in order, zero-padded to whole words (no decoding). Any fixed packing serves the
        diagnostics' popcounts (:func:`~lightning_dfl.federation.metrics.spread.packed_masks`)."""
        size = sum(-(-self.numels[n] // 8) for n in self.masked_names)
        out = torch.zeros((len(nodes), -(-size // 8) * 8), dtype=torch.uint8, device=self.device)
        if self.masked_names:
            out[:, :size] = torch.stack([torch.cat([self._start(k)["bits"][n] for n in self.masked_names])
                                         for k in nodes])
        return out.view(torch.int64)

    # -- reads --------------------------------------------------------------------------
    def mask(self, node: int) -> Masks:
        """``node``'s current mask (new tensors; on an accelerator views of one new buffer, every layer unpacked
        at once)."""
        bits = self.current_bits[node]
        if host_reads_are_cheap(self.device) or not self.masked_names:
            return {n: unpack_bits(bits[n], self.numels[n], BIT_ORDER).view(self.shapes[n]) for n in self.masked_names}
        flat, offsets = unpack_bits_together(bits, self.masked_names)
        return {n: flat[offsets[n]:offsets[n] + self.numels[n]].view(self.shapes[n]) for n in self.masked_names}

    def published(self, node: int, fresh: bool = False) -> tuple[dict[str, Tensor], Masks]:
        """A node's published weights and mask (start of round, or this round's if ``fresh``), rebuilt
        dense; read-only."""
        return self._expand(self._latest(node, fresh))

    def published_record(self, node: int, fresh: bool = False) -> dict[str, Any]:
        """A node's published record as it is kept (``values``, ``bits``, ``neg`` by parameter and ``active``;
        the module docstring): read-only, shared with the store (what a partitioned store sends)."""
        return self._latest(node, fresh)

    def expand_record(self, record: Mapping[str, Any]) -> tuple[dict[str, Tensor], Masks]:
        """A record of this store's layout (:meth:`published_record`'s, from any process) rebuilt dense:
        weights and mask by name, as :meth:`published` gives them."""
        return self._expand(record)

    def gather(self, sources: list[tuple[int, bool]]) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
        """Several ``(node, fresh)`` sources' weights and published masks, by name, rebuilt dense."""
        return gather_published(self, sources)

    def active_values(self, node: int, fresh: bool = False) -> int:
        """Values a node's published model sends: active masked entries plus all unmasked entries."""
        return int(self._latest(node, fresh)["active"])

    def masked_size(self) -> int:
        """Entries under a mask (one bit each when a mask is sent)."""
        return sum(self.numels[n] for n in self.masked_names)

    # -- checkpoints and memory ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The records as they are, on the CPU (for checkpoints; a saved record's tensors keep their
        sharing, also when copied from another device); call between rounds."""
        self._check_between_rounds()
        records, current_bits = list(self.records), list(self.current_bits)
        fields = {name: dict(parts) for name, parts in self.fields.items()}
        if self.device.type != "cpu":
            copies: dict[int, Tensor] = {}  # by id: a tensor shared by records and current masks is copied once

            def cpu(parts: Mapping[str, Tensor]) -> dict[str, Tensor]:
                return {n: copies[id(t)] if id(t) in copies else copies.setdefault(id(t), t.cpu())
                        for n, t in parts.items()}

            records = [None if r is None else {**r, "values": cpu(r["values"]), "bits": cpu(r["bits"]),
                                               "neg": cpu(r["neg"])} for r in records]
            current_bits = [cpu(bits) for bits in current_bits]
            fields = {name: cpu(parts) for name, parts in fields.items()}
        return {"format": FORMAT, "names": list(self.names), "masked_names": list(self.masked_names),
                "shapes": {n: list(s) for n, s in self.shapes.items()}, "records": records,
                "current_bits": current_bits, "slot": self.slot, "fields": fields}

    @staticmethod
    def check_saved_state(saved: Mapping[str, Any], layout: StoreLayout) -> None:
        """Refuse a compact store's saved state (:meth:`state_dict`'s, ``format == "compact"``) that cannot load
        into a store of ``layout``: :func:`~lightning_dfl.federation.store.records.check_compact_state`."""
        check_compact_state(saved, layout)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, or a dense store's (compressed), into this store."""
        if state.get("format") != FORMAT:
            self._load_dense(state)
            return
        theirs = {n: tuple(s) for n, s in state["shapes"].items()}
        if (list(state["names"]) != self.names or list(state["masked_names"]) != self.masked_names
                or theirs != self.shapes or len(state["records"]) != self.num_nodes):
            raise ValueError(f"the checkpoint's compact store does not fit this store: it has "
                             f"{len(state['records'])} nodes, shapes {theirs} and masked names "
                             f"{list(state['masked_names'])}; the store {self.num_nodes} nodes, shapes "
                             f"{self.shapes} and masked names {self.masked_names}")
        pairs = self._field_pairs(state)
        self._check_pairs(pairs)
        records = [self._checked(record, k) for k, record in enumerate(state["records"])]
        current = [self._checked({"bits": bits, "values": {}, "neg": {}}, k)["bits"]
                   for k, bits in enumerate(state["current_bits"])]
        self._adopt(records, current, state["slot"], pairs)

    def _checked(self, record: Mapping[str, Any], node: int) -> dict[str, Any]:
        """A loaded record on this store's device, its sizes checked against the shapes."""
        def fail(what: str) -> ValueError:
            return ValueError(f"the checkpoint's record of node {node} is damaged: {what}")

        bits = {n: b.to(self.device) for n, b in record["bits"].items()}
        if set(bits) != set(self.masked_names):
            raise fail(f"mask bits for {sorted(bits)}, expected {self.masked_names}")
        for n, b in bits.items():
            if b.dtype != torch.uint8 or b.numel() != math.ceil(self.numels[n] / 8):
                raise fail(f"{n}'s mask bits have {b.numel()} {b.dtype} entries")
        values = {n: v.to(self.device) for n, v in record["values"].items()}
        if values and set(values) != set(self.names):
            raise fail(f"values for {sorted(values)}, expected {self.names}")
        for n, v in values.items():
            full = v.numel() == self.numels[n]
            if v.dtype != self.dtypes[n] or not (full or (n in self._masked and v.numel() < self.numels[n])):
                raise fail(f"{n} has {v.numel()} {v.dtype} values for {self.numels[n]} entries of {self.dtypes[n]}")
        out = dict(record)
        out.update(bits=bits, values=values, neg={n: b.to(self.device) for n, b in record["neg"].items()})
        if "active" in record:
            out["active"] = int(record["active"])
        return out

    def _load_dense(self, state: Mapping[str, Any]) -> None:
        """A dense store's checkpoint: each node's current slot compressed."""
        for key in ("weights", "published_masks", "masks"):
            if key not in state:
                raise ValueError(f"the checkpoint's store has no {key!r}: neither a dense nor a compact store")
        pairs = [(key, {n: self.shapes[n] for n in names}, state[key])
                 for key, names in (("weights", self.names), ("published_masks", self.masked_names),
                                    ("masks", self.masked_names))]
        for key, shapes, theirs in pairs:
            lead = 2 if key != "masks" else 1
            if set(shapes) != set(theirs) or any(tuple(theirs[n].shape[lead:]) != shapes[n]
                                                 or theirs[n].shape[lead - 1] != self.num_nodes for n in shapes):
                raise ValueError(f"the checkpoint's {key} do not fit this store: it has "
                                 f"{ {n: tuple(t.shape) for n, t in theirs.items()} }, the store "
                                 f"{self.num_nodes} nodes of { {n: shapes[n] for n in shapes} }")
        field_pairs = self._field_pairs(state)
        self._check_pairs(field_pairs)
        slot, active = state["slot"], state["active"]
        records, current = [], []
        for k in range(self.num_nodes):
            s = int(slot[k])
            weights = self._copies({n: state["weights"][n][s, k] for n in self.names}, self.names)
            masks = self._all_masks({n: state["published_masks"][n][s, k] for n in self.masked_names})
            record = self._record(weights, masks, int(active[s, k]))
            bits = pack_bits_all(self._all_masks({n: state["masks"][n][k] for n in self.masked_names}))
            records.append(record)
            current.append({n: record["bits"][n] if torch.equal(record["bits"][n], b) else b for n, b in bits.items()})
        self._adopt(records, current, slot, field_pairs)

    def _adopt(self, records: list[dict[str, Any]], current: list[dict[str, Tensor]], slot: Tensor,
               field_pairs: list[tuple[str, dict[str, Tensor], Mapping[str, Tensor]]]) -> None:
        """A loaded checkpoint's records, current masks, slots and fields become the store's (checked
        before: nothing is changed when a check fails); no round is running."""
        copy_all_((mine[n], theirs[n]) for _, mine, theirs in field_pairs for n in mine)  # from any device
        self.records, self.current_bits = records, current
        self.fresh_records.clear()
        self.slot.copy_(slot)
        self._written.clear()

    def _tensors(self) -> Iterator[Tensor]:
        for record in [*self.records, *self.fresh_records.values()]:
            if record is None:  # freed after its last reader
                continue
            for part in ("values", "bits", "neg"):
                yield from record[part].values()
        for bits in self.current_bits:
            yield from bits.values()

    def nbytes(self) -> int:
        """Memory held by the store's tensors (each shared storage once)."""
        return _storages(self._tensors()) + self._fields.nbytes()

    def breakdown(self) -> dict[str, int]:
        """:meth:`nbytes` by kind: active values, dense-kept tensors, published mask bits, zero signs,
        current masks that differ from the published ones, fields."""
        out = dict.fromkeys(("values", "dense", "mask_bits", "zero_signs", "current_mask_bits", "fields"), 0)
        seen: set[tuple[str, int]] = set()

        def add(kind: str, t: Tensor) -> None:
            key = (str(t.device), t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                out[kind] += t.untyped_storage().nbytes()

        for record in [*self.records, *self.fresh_records.values()]:
            if record is None:
                continue
            for n, v in record["values"].items():
                add("dense" if n not in self._masked or v.numel() == self.numels[n] else "values", v)
            for b in record["bits"].values():
                add("mask_bits", b)
            for b in record["neg"].values():
                add("zero_signs", b)
        for bits in self.current_bits:
            for b in bits.values():
                add("current_mask_bits", b)
        out["fields"] = self._fields.nbytes()
        return out
