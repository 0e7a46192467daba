"""What travels between nodes: a sender's model, encoded by a codec, with the bytes it costs.

Conventions (papers README, "Communication"; baselines notes, top): a message counts the values it
carries (``value_bytes``, 4 bytes per floating value by default) and, in their own column, the side
information that places them (``index_bytes``: mask bits, indices, or any other). Non-floating
tensors (BatchNorm's ``num_batches_tracked``) travel as they are and count their element size.

The receiver gets dense tensors of the parameter shapes, zeros where nothing was sent, and the mask
of the entries that were sent (``None``: every entry), which masked averaging
(:func:`lightning_dfl.federation.exchange.aggregation.masked_average`, see :func:`gather_messages`) uses as
its divisor.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from lightning_dfl.checks import check_bool, check_int
from lightning_dfl.transfers import to_device

#: the largest magnitude a published value may have: a model (or published field) with a larger one, finite or not,
#: is contained at its sender, and a checkpoint holding one is refused. 1e30 leaves a margin of 3e8 to float32's
#: (and bfloat16's) largest value, so that no weighted sum of published models overflows; values sent or stored in
#: a dtype with a smaller range (float16) are bounded by its own largest (:func:`dtype_bound`).
PUBLISH_BOUND = 1e30


def dtype_bound(dtype: torch.dtype) -> float:
    """:data:`PUBLISH_BOUND`, or ``dtype``'s largest finite value when smaller (float16: 65504)."""
    return min(PUBLISH_BOUND, torch.finfo(dtype).max) if dtype.is_floating_point else PUBLISH_BOUND


@dataclass
class Message:
    """One model crossing one edge, as its receiver reconstructs it.

    Attributes:
        sender: the node that sent it.
        weights: name -> dense tensor of the parameter's shape, zeros where nothing was sent (for
            :class:`MaskedCodec`, the sender's store views: receivers never modify them).
        mask: name -> boolean mask of the entries the receiver holds from this message (masked
            averaging's divisor); names without one, or ``None``: every entry is held.
        value_bytes: bytes of the values sent.
        index_bytes: bytes of the side information that places them (mask bits, indices, ...).
    """

    sender: int
    weights: dict[str, Tensor]
    mask: dict[str, Tensor] | None
    value_bytes: int
    index_bytes: int

    @property
    def nbytes(self) -> int:
        """All bytes sent: values plus side information."""
        return self.value_bytes + self.index_bytes


def _dense_bytes(tensor: Tensor, bytes_per_value: int) -> int:
    """Every entry: ``bytes_per_value`` each if floating, its element size otherwise."""
    return tensor.numel() * (bytes_per_value if tensor.is_floating_point() else tensor.element_size())


def _mask_bytes(weights: Mapping[str, Tensor], masked_names: Sequence[str]) -> int:
    """One bit per masked entry, for the whole model (``RoundAccounting.transfer``'s convention)."""
    return math.ceil(sum(weights[n].numel() for n in masked_names) / 8)


class Codec:
    """Turns a sender's published model into the :class:`Message` its receivers get.

    ``encode``'s ``weights`` are the sender's tensors by name, zero outside ``mask`` (the sender's
    boolean mask over ``masked_names``; ``None``: every entry is active). Codecs whose output is random
    draw only from ``generator``.
    """

    name = ""

    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None) -> Message:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The codec's state across rounds (for checkpoints); none by default."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        if state:
            raise ValueError(f"the {self.name!r} codec holds no state, got keys {sorted(state)}")


class MaskedCodec(Codec):
    """Lossless sparse models with their masks (DisPFL Alg. 1, DA-DPFL Eq. 7): the active values
    (entries under the mask of masked parameters, every entry of the others) and, if ``send_mask``
    and a mask is given, one bit per masked entry, ``ceil(bits / 8)`` bytes for the whole model.

    The payload is the input tensors themselves, no copy. The message carries the sender's mask
    whether or not its bits are counted: a receiver that is not sent it knows it already (D-PSGD's
    shared mask), so the average is the same either way.

    Args:
        send_mask: count the mask bits (algorithms with personal masks).
        bytes_per_value: bytes counted per floating value (accounting only: values are not rounded).
    """

    name = "masked"

    def __init__(self, send_mask: bool = True, bytes_per_value: int = 4) -> None:
        self.send_mask = check_bool("send_mask", send_mask)
        self.bytes_per_value = check_int("bytes_per_value", bytes_per_value, 1)

    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None,
               active_values: int | None = None) -> Message:
        """``active_values``: the entries sent, counted as ``ClientStore.active_values`` counts them
        (non-floating entries included); given, no tensor's data is read."""
        if active_values is None:
            held = set(masked_names) if mask is not None else set()
            active_values = sum(int(mask[n].sum()) if n in held else t.numel() for n, t in weights.items())
        per_value = self.bytes_per_value
        value_bytes = active_values * per_value + sum(
            t.numel() * (t.element_size() - per_value) for t in weights.values() if not t.is_floating_point())
        index_bytes = _mask_bytes(weights, masked_names) if self.send_mask and mask is not None else 0
        return Message(sender, dict(weights), None if mask is None else dict(mask), value_bytes, index_bytes)


class DenseCodec(Codec):
    """Every entry of every tensor, no mask (FedAvg, D-PSGD, DFedAvgM, FedFomo: dense models).

    Args:
        bytes_per_value: bytes counted per floating value (accounting only: values are not rounded).
    """

    name = "dense"

    def __init__(self, bytes_per_value: int = 4) -> None:
        self.bytes_per_value = check_int("bytes_per_value", bytes_per_value, 1)

    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None) -> Message:
        value_bytes = sum(_dense_bytes(t, self.bytes_per_value) for t in weights.values())
        return Message(sender, dict(weights), None, value_bytes, 0)


class _SparsifyingCodec(Codec):
    """Per floating tensor, ``k = ceil(ratio * n)`` of its ``n`` candidate entries (the sender's
    active entries of a masked parameter, every entry otherwise), sent as values plus flat indices,
    ``bytes_per_index`` each. The receiver's mask marks the sent entries, so masked averaging
    averages each entry over the senders that sent it. ``ratio`` is read as the decimal written
    (``ceil(0.1 * 30)`` is 3)."""

    def __init__(self, ratio: float, bytes_per_value: int = 4, bytes_per_index: int = 4) -> None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self._ratio = Fraction(repr(self.ratio))
        self.bytes_per_value = check_int("bytes_per_value", bytes_per_value, 1)
        self.bytes_per_index = check_int("bytes_per_index", bytes_per_index, 0)

    def _select(self, flat: Tensor, held: Tensor | None, k: int, generator: torch.Generator | None) -> Tensor:
        """Flat indices of the ``k`` entries of ``flat`` to send, among ``held`` (``None``: all)."""
        raise NotImplementedError

    @torch.no_grad()
    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None) -> Message:
        masked = set(masked_names) if mask is not None else set()
        out: dict[str, Tensor] = {}
        sent_masks: dict[str, Tensor] = {}
        value_bytes = index_bytes = 0
        for name, tensor in weights.items():
            if not tensor.is_floating_point():
                out[name] = tensor
                value_bytes += _dense_bytes(tensor, self.bytes_per_value)
                continue
            flat = tensor.reshape(-1)
            held = mask[name].reshape(-1) if name in masked else None
            k = math.ceil(self._ratio * (flat.numel() if held is None else int(held.sum())))
            chosen = self._select(flat, held, k, generator) if k else flat.new_empty(0, dtype=torch.long)
            values = torch.zeros_like(flat)
            values[chosen] = flat[chosen]
            sent = torch.zeros(flat.shape, dtype=torch.bool, device=flat.device)
            sent[chosen] = True
            out[name], sent_masks[name] = values.view_as(tensor), sent.view_as(tensor)
            value_bytes += k * self.bytes_per_value
            index_bytes += k * self.bytes_per_index
        return Message(sender, out, sent_masks, value_bytes, index_bytes)


class TopKCodec(_SparsifyingCodec):
    """Top-k sparsification: per tensor, the ``ceil(ratio * n)`` entries of largest magnitude, ties
    going to the lower flat index.

    GossipFL (SAPS_FL's top-k option) sends them to its matched peer, which averages each entry over
    the models that hold it (its own and the peer's sent entries: the message mask is the divisor);
    the two sides' index sets differ. BEER (top-k option for C) sends compressed differences
    ``C(X - H)``, ``C(V - G)``: the receiver adds the dense decoded tensor (zeros where nothing was
    sent) to its running sums and ignores the mask.

    Args:
        ratio: the share of each tensor's candidate entries sent, in (0, 1].
        bytes_per_value: bytes per sent value.
        bytes_per_index: bytes per sent index (4: an int32 flat position).
    """

    name = "top_k"

    def _select(self, flat: Tensor, held: Tensor | None, k: int, generator: torch.Generator | None) -> Tensor:
        magnitude = flat.abs()
        if held is not None:
            magnitude.masked_fill_(~held, -1.0)  # below every candidate; k <= held entries
        threshold = magnitude.kthvalue(flat.numel() - k + 1).values
        above = (magnitude > threshold).nonzero().squeeze(1)
        ties = (magnitude == threshold).nonzero().squeeze(1)[: k - above.numel()]
        return torch.cat([above, ties])


class RandomKCodec(_SparsifyingCodec):
    """Random-k sparsification: per tensor, ``ceil(ratio * n)`` candidate entries drawn uniformly
    without replacement from ``generator`` (required), so the draw depends on its seed only.

    GossipFL's default (SAPS_FL, ``compress_ratio`` 0.01). Two peers drawing from generators in the
    same state select the same entries (GossipFL's shared-seed pairwise average): the receiver then
    regenerates the indices, which ``bytes_per_index=0`` counts. As an option for BEER's C, see
    :class:`TopKCodec`.

    Args:
        ratio: the share of each tensor's candidate entries sent, in (0, 1].
        bytes_per_value: bytes per sent value.
        bytes_per_index: bytes per sent index (0: shared seed, the indices are not sent).
    """

    name = "random_k"

    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None) -> Message:
        if generator is None:
            raise ValueError("the 'random_k' codec needs a torch.Generator (generator=...), got None")
        return super().encode(weights, mask, sender=sender, masked_names=masked_names, generator=generator)

    def _select(self, flat: Tensor, held: Tensor | None, k: int, generator: torch.Generator | None) -> Tensor:
        candidates = None if held is None else held.nonzero().squeeze(1)
        n = flat.numel() if candidates is None else candidates.numel()
        draw = torch.randperm(n, generator=generator, device=generator.device)[:k].to(flat.device)
        return draw if candidates is None else candidates[draw]


class QuantizedCodec(Codec):
    """Uniform quantization per tensor between its min and max with ``2^bits`` levels (DFedAvgM's
    quantized variant Q; a compressor C for BEER, whose default :class:`GSGDCodec` is a different,
    norm-based one).

    Each floating tensor costs ``ceil(n * bits / 8)`` bytes plus 8 (its min and step as float32), none
    if ``n`` is 0. Rounding is to the nearest level (error at most half a step) or, if ``stochastic``,
    up with probability equal to the remainder, drawn from ``generator`` (unbiased). With a sender
    mask, only active entries are quantized and counted (zeros elsewhere), the mask travels with the
    message, and, if ``send_mask``, its bits count as in :class:`MaskedCodec`. Arithmetic is in
    float64; the result is cast back to the tensor's dtype.

    Args:
        bits: bits per value, 1 to 32.
        stochastic: stochastic rather than nearest rounding.
        send_mask: count the mask bits when a mask is given.
    """

    name = "quantized"

    def __init__(self, bits: int = 8, stochastic: bool = False, send_mask: bool = True) -> None:
        self.bits = check_int("bits", bits, 1, 32)
        self.stochastic = check_bool("stochastic", stochastic)
        self.send_mask = check_bool("send_mask", send_mask)

    @torch.no_grad()
    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None) -> Message:
        if self.stochastic and generator is None:
            raise ValueError("the 'quantized' codec with stochastic=True needs a torch.Generator (generator=...), "
                             "got None")
        masked = set(masked_names) if mask is not None else set()
        out: dict[str, Tensor] = {}
        value_bytes = 0
        for name, tensor in weights.items():
            if not tensor.is_floating_point():
                out[name] = tensor
                value_bytes += tensor.numel() * tensor.element_size()
                continue
            if name in masked:
                held = mask[name]
                values = tensor[held]
                out[name] = torch.zeros_like(tensor).masked_scatter_(held, self._roundtrip(values, generator))
            else:
                values = tensor
                out[name] = self._roundtrip(values, generator)
            value_bytes += (math.ceil(values.numel() * self.bits / 8) + 8) if values.numel() else 0
        index_bytes = _mask_bytes(weights, masked_names) if self.send_mask and mask is not None else 0
        return Message(sender, out, None if mask is None else dict(mask), value_bytes, index_bytes)

    def _roundtrip(self, values: Tensor, generator: torch.Generator | None) -> Tensor:
        """``values`` quantized and dequantized, as the receiver reconstructs them."""
        if values.numel() == 0:
            return values.clone()
        x = values.double()
        top = 2**self.bits - 1
        low = x.min()
        step = (x.max() - low) / top
        level = (x - low) / step.clamp_min(torch.finfo(torch.float64).tiny)  # all 0 for a constant tensor
        if self.stochastic:
            noise = torch.rand(level.shape, generator=generator, device=generator.device, dtype=torch.float64)
            level.add_(noise.to(level.device)).floor_()
        else:
            level.round_()
        return (low + level.clamp_(0, top) * step).to(values.dtype)


#: gsgd's dither: uniform (the BEER paper) or normal (the authors' code)
GSGD_NOISES = ("uniform", "normal")


def gsgd(x: Tensor, bits: int, generator: torch.Generator | None = None, noise: str = "uniform") -> Tensor:
    """gsgd_b(x) = sign(x) floor(2^{b-1} |x| / ||x|| + xi)_+ ||x|| / (2^{b-1} tau), tau = 1 + delta if
    delta > 1 else 1 + delta^2, delta = sqrt(d) / 2^{b-1}; xi ~ U[0, 1) (the paper) or N(0, 1) (the
    code). As the code, a vector of norm below 1e-10 is returned as it is."""
    norm = torch.linalg.vector_norm(x)
    if norm < 1e-10:
        return x.clone()
    levels = 2.0 ** (bits - 1)
    delta = math.sqrt(x.numel()) / levels
    tau = 1 + delta if delta > 1 else 1 + delta**2
    draw = torch.rand if noise == "uniform" else torch.randn
    xi = to_device(draw(x.shape, generator=generator, dtype=x.dtype), x.device)
    level = (levels / norm * x.abs() + xi).floor_().clamp_min_(0)
    return x.sign() * level * (norm / levels / tau)


class GSGDCodec(Codec):
    """gsgd_b over all floating tensors flattened into one vector (the original compresses the flat
    model): b bits per value (sign and level) plus the norm as float32, ``ceil(d b / 8) + 4`` bytes."""

    name = "gsgd"

    def __init__(self, bits: int = 9, noise: str = "uniform") -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 32:
            raise ValueError(f"bits must be an integer in [2, 32], got {bits!r}")
        if noise not in GSGD_NOISES:
            raise ValueError(f"unknown noise {noise!r}; allowed: {', '.join(GSGD_NOISES)}")
        self.bits, self.noise = bits, noise

    @torch.no_grad()
    def encode(self, weights: Mapping[str, Tensor], mask: Mapping[str, Tensor] | None, *, sender: int,
               masked_names: Sequence[str], generator: torch.Generator | None = None) -> Message:
        names = [n for n, t in weights.items() if t.is_floating_point()]
        out = {n: t for n, t in weights.items() if not t.is_floating_point()}
        value_bytes = sum(t.numel() * t.element_size() for t in out.values())
        if names:
            flat = torch.cat([weights[n].reshape(-1) for n in names])
            decoded = gsgd(flat, self.bits, generator, self.noise)
            for n, part in zip(names, decoded.split([weights[n].numel() for n in names])):
                out[n] = part.view_as(weights[n])
            value_bytes += math.ceil(flat.numel() * self.bits / 8) + 4
        return Message(sender, {n: out[n] for n in weights}, None, value_bytes, 0)


#: The codecs by name: the one registry (algorithms choose theirs with :func:`choose_codec`).
CODECS: dict[str, type[Codec]] = {c.name: c for c in (MaskedCodec, DenseCodec, TopKCodec, RandomKCodec, QuantizedCodec,
                                                     GSGDCodec)}
#: other names an algorithm's option may give a codec (BEER's ``"identity"``: no compression)
CODEC_ALIASES = {"identity": "dense"}
#: the default codecs (stateless, shared): :class:`MaskedCodec` without and with the mask bits counted
_MASKED_CODECS = {False: MaskedCodec(send_mask=False), True: MaskedCodec(send_mask=True)}


def build_codec(name: str, **kwargs: Any) -> Codec:
    """The codec called ``name`` (see :data:`CODECS`), built with ``kwargs``."""
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; allowed: {', '.join(CODECS)}")
    return CODECS[name](**kwargs)


def masked_codec(send_mask: bool) -> MaskedCodec:
    """The shared :class:`MaskedCodec` (4 bytes per value) without or with the mask bits counted: the
    default :meth:`~lightning_dfl.federation.algorithms.base.Algorithm.message`'s codec."""
    return _MASKED_CODECS[bool(send_mask)]


def check_codec_choice(name: str, allowed: Sequence[str] | Mapping[str, Mapping[str, Any]],
                       option: str = "codec") -> None:
    """Raise ``ValueError`` unless ``name`` is one of ``allowed`` (an algorithm's ``option``)."""
    if name not in allowed:
        raise ValueError(f"unknown {option} {name!r}; allowed: {', '.join(allowed)}")


def choose_codec(name: str, allowed: Sequence[str] | Mapping[str, Mapping[str, Any]], option: str = "codec",
                 **settings: Any) -> Codec:
    """The codec an algorithm's ``option`` names: ``name`` must be one of ``allowed`` (names of
    :data:`CODECS` or :data:`CODEC_ALIASES`; a mapping gives per name settings fixed by the algorithm,
    e.g. GossipFL's ``{"random_k": {"bytes_per_index": 0}}``). The codec is built with those of
    ``settings`` (and the fixed ones) its constructor takes; the others are ignored (``bits`` for top-k)."""
    check_codec_choice(name, allowed, option)
    cls = CODECS[CODEC_ALIASES.get(name, name)]
    if isinstance(allowed, Mapping):
        settings = {**settings, **allowed[name]}
    params = inspect.signature(cls.__init__).parameters
    return cls(**{key: value for key, value in settings.items() if key in params})


def gather_messages(messages: Sequence[Message]) -> tuple[dict[str, list[Tensor]], dict[str, list[Tensor]]]:
    """``masked_average``'s weights and masks, by name, for several messages. A name any message
    masks gets a mask from every message, all-ones (an expanded view, no copy) where one has none."""
    weights = {n: [m.weights[n] for m in messages] for n in messages[0].weights}
    masked = {n for m in messages if m.mask is not None for n in m.mask}
    masks: dict[str, list[Tensor]] = {}
    for name in (n for n in weights if n in masked):
        masks[name] = [m.mask[name] if m.mask is not None and name in m.mask
                       else torch.ones((), dtype=torch.bool, device=t.device).expand(t.shape)
                       for m, t in zip(messages, weights[name])]
    return weights, masks
