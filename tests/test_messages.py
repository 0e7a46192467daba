import pytest
import torch

from lightning_dfl.federation import masked_average
from lightning_dfl.federation.exchange.messages import (
    CODECS,
    DenseCodec,
    GSGDCodec,
    MaskedCodec,
    QuantizedCodec,
    RandomKCodec,
    TopKCodec,
    build_codec,
    choose_codec,
    gather_messages,
    masked_codec,
)
from lightning_dfl.federation.store import DenseClientStore

MASKED = ["w"]


def tiny_model():
    """A masked 2x4 weight (6 active entries, zero elsewhere), an unmasked bias of 3 and an int64 counter."""
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1]], dtype=torch.bool)
    w = torch.tensor([[0.5, -3.0, 0.0, 2.0], [1.0, 0.0, -4.0, 0.25]])
    b = torch.tensor([0.1, -0.2, 0.3])
    return {"w": w, "b": b, "count": torch.tensor(7)}, {"w": mask}


# -- byte counts by hand -------------------------------------------------------------------
# int64 counter: 8 bytes everywhere; mask bits: ceil(8 / 8) = 1 byte
@pytest.mark.parametrize("codec, with_mask, value_bytes, index_bytes", [
    (MaskedCodec(), True, (6 + 3) * 4 + 8, 1),
    (MaskedCodec(send_mask=False), True, (6 + 3) * 4 + 8, 0),
    (MaskedCodec(), False, (8 + 3) * 4 + 8, 0),
    (MaskedCodec(bytes_per_value=2), True, (6 + 3) * 2 + 8, 1),
    (DenseCodec(), True, (8 + 3) * 4 + 8, 0),
    (DenseCodec(bytes_per_value=2), False, (8 + 3) * 2 + 8, 0),
    # k = ceil(0.5 * 6) + ceil(0.5 * 3) = 3 + 2 values and indices
    (TopKCodec(0.5), True, 5 * 4 + 8, 5 * 4),
    (TopKCodec(0.5, bytes_per_value=2, bytes_per_index=8), True, 5 * 2 + 8, 5 * 8),
    # without the mask: ceil(0.5 * 8) + 2
    (TopKCodec(0.5), False, 6 * 4 + 8, 6 * 4),
    (RandomKCodec(0.5), True, 5 * 4 + 8, 5 * 4),
    (RandomKCodec(0.5, bytes_per_index=0), False, 6 * 4 + 8, 0),
    # per tensor ceil(n bits / 8) + 8: w 6 active entries, b 3
    (QuantizedCodec(bits=8), True, (6 + 8) + (3 + 8) + 8, 1),
    (QuantizedCodec(bits=8, send_mask=False), True, (6 + 8) + (3 + 8) + 8, 0),
    (QuantizedCodec(bits=8), False, (8 + 8) + (3 + 8) + 8, 0),
    (QuantizedCodec(bits=3, stochastic=True), True, (3 + 8) + (2 + 8) + 8, 1),
])
def test_byte_counts_by_hand(codec, with_mask, value_bytes, index_bytes):
    weights, mask = tiny_model()
    message = codec.encode(weights, mask if with_mask else None, sender=3, masked_names=MASKED,
                           generator=torch.Generator().manual_seed(0))
    assert (message.value_bytes, message.index_bytes) == (value_bytes, index_bytes)
    assert message.nbytes == value_bytes + index_bytes
    assert message.sender == 3
    assert message.weights["count"] is weights["count"]  # non-floating tensors travel as they are


def test_masked_codec_fast_path_equals_slow_path_on_store_views():
    weights, mask = tiny_model()
    store = DenseClientStore(weights, MASKED, num_nodes=2)
    store.initialize(0, weights, mask)
    store.initialize(1, weights, None)
    for node in (0, 1):
        views, published = store.published(node)
        for codec in (MaskedCodec(), MaskedCodec(send_mask=False)):
            slow = codec.encode(views, published, sender=node, masked_names=MASKED)
            fast = codec.encode(views, published, sender=node, masked_names=MASKED,
                                active_values=store.active_values(node))
            assert (fast.value_bytes, fast.index_bytes) == (slow.value_bytes, slow.index_bytes)
            # the payload is the store's storage, not a copy
            for name, tensor in views.items():
                assert fast.weights[name] is tensor
                assert fast.weights[name].data_ptr() == store.weights[name][0, node].data_ptr()
            assert fast.mask["w"] is published["w"]
    # node 1 is dense: 8 + 3 floats and the int64 counter, plus its (all-ones) mask bits
    assert MaskedCodec().encode(*store.published(1), sender=1, masked_names=MASKED).nbytes == 11 * 4 + 8 + 1


def test_masked_codec_fast_path_reads_no_tensor_data():
    weights, mask = tiny_model()
    meta = {n: t.to("meta") for n, t in weights.items()}  # any read of data would fail
    message = MaskedCodec().encode(meta, {"w": mask["w"].to("meta")}, sender=0, masked_names=MASKED,
                                   active_values=10)
    assert (message.value_bytes, message.index_bytes) == (9 * 4 + 8, 1)


# -- top-k and random-k ----------------------------------------------------------------------
def test_top_k_keeps_the_largest_magnitudes_and_marks_them():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    message = TopKCodec(0.1).encode({"x": x}, None, sender=0, masked_names=[])
    sent = message.mask["x"]
    assert int(sent.sum()) == 100
    assert x[sent].abs().min() > x[~sent].abs().max()
    assert torch.equal(message.weights["x"][sent], x[sent])
    assert not message.weights["x"][~sent].any()


def test_top_k_within_the_sender_mask_and_deterministic_ties():
    weights, mask = tiny_model()
    message = TopKCodec(0.5).encode(weights, mask, sender=0, masked_names=MASKED)
    # active magnitudes 0.5, 3, 2, 1, 4, 0.25: keep 4, 3, 2; bias: 0.3 and -0.2
    assert torch.equal(message.mask["w"], torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.bool))
    assert torch.equal(message.weights["w"], torch.tensor([[0.0, -3.0, 0.0, 2.0], [0.0, 0.0, -4.0, 0.0]]))
    assert torch.equal(message.mask["b"], torch.tensor([False, True, True]))
    ties = TopKCodec(0.4).encode({"x": torch.tensor([1.0, -2.0, 2.0, 1.0, 2.0])}, None, sender=0, masked_names=[])
    assert torch.equal(ties.mask["x"], torch.tensor([False, True, True, False, False]))  # lower index first


def test_ratio_is_read_as_the_decimal_written():
    message = TopKCodec(0.1).encode({"x": torch.arange(30.0)}, None, sender=0, masked_names=[])
    assert int(message.mask["x"].sum()) == 3  # not ceil(3.0000000000000004) = 4


def test_random_k_depends_on_the_seed_only_and_keeps_exactly_k():
    x = torch.randn(200, generator=torch.Generator().manual_seed(0))
    held = torch.rand(200, generator=torch.Generator().manual_seed(1)) < 0.5
    codec = RandomKCodec(0.25)

    def draw(seed):
        return codec.encode({"x": x * held}, {"x": held}, sender=0, masked_names=["x"],
                            generator=torch.Generator().manual_seed(seed))

    first, again, other = draw(5), draw(5), draw(6)
    assert torch.equal(first.mask["x"], again.mask["x"])
    assert not torch.equal(first.mask["x"], other.mask["x"])
    k = -(-int(held.sum()) // 4)
    for message in (first, other):
        sent = message.mask["x"]
        assert int(sent.sum()) == k
        assert not (sent & ~held).any()  # drawn among the sender's active entries
        assert torch.equal(message.weights["x"], torch.where(sent, x, 0.0))


def test_top_k_messages_average_each_entry_over_its_senders():
    models = [[4.0, 1.0, -3.0, 0.0, 0.5], [1.0, 5.0, 2.0, 0.5, 0.1], [-6.0, 0.0, 1.0, 7.0, 0.2]]
    codec = TopKCodec(0.4)  # 2 of 5 entries each
    messages = [codec.encode({"x": torch.tensor(m), "count": torch.tensor(j)}, None, sender=j, masked_names=[])
                for j, m in enumerate(models)]
    weights, masks = gather_messages(messages)
    out = masked_average(weights, masks)
    # entry 0: (4 - 6) / 2, 1: 5 alone, 2: (-3 + 2) / 2, 3: 7 alone, 4: sent by nobody
    assert torch.equal(out["x"], torch.tensor([-1.0, 5.0, -0.5, 7.0, 0.0]))
    assert set(masks) == {"x"}


def test_gather_messages_holds_every_entry_of_a_message_without_mask():
    own = DenseCodec().encode({"x": torch.tensor([2.0, 4.0, 6.0])}, None, sender=0, masked_names=[])
    peer = TopKCodec(0.3).encode({"x": torch.tensor([0.0, 8.0, 1.0])}, None, sender=1, masked_names=[])
    out = masked_average(*gather_messages([own, peer]))
    assert torch.equal(out["x"], torch.tensor([2.0, 6.0, 6.0]))  # GossipFL's 1/2 own + 1/2 peer where sent


# -- quantization ----------------------------------------------------------------------------
def test_quantized_error_is_at_most_half_a_step():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    message = QuantizedCodec(bits=8).encode({"x": x}, None, sender=0, masked_names=[])
    step = (x.max() - x.min()) / 255
    assert message.mask is None
    assert (message.weights["x"] - x).abs().max() <= step / 2 + 1e-6
    assert message.weights["x"].unique().numel() <= 256


def test_stochastic_quantization_is_unbiased():
    x = torch.randn(50, generator=torch.Generator().manual_seed(0))
    codec = QuantizedCodec(bits=2, stochastic=True)
    generator = torch.Generator().manual_seed(1)
    draws = torch.stack([codec.encode({"x": x}, None, sender=0, masked_names=[], generator=generator).weights["x"]
                         for _ in range(2000)])
    step = float(x.max() - x.min()) / 3
    assert draws.std(dim=0).max() > step / 10  # it does round at random
    assert (draws.mean(dim=0) - x).abs().max() < 0.05 * step * 3  # within about 6 standard errors


def test_quantized_with_a_mask_quantizes_only_active_entries():
    x = torch.tensor([1.0, 1.2, 0.0, 1.9, 2.0])
    held = torch.tensor([True, True, False, True, True])
    message = QuantizedCodec(bits=1).encode({"x": x}, {"x": held}, sender=0, masked_names=["x"])
    # range [1, 2] of the active entries, not [0, 2]: levels 1 and 2
    assert torch.equal(message.weights["x"], torch.tensor([1.0, 1.0, 0.0, 2.0, 2.0]))
    assert message.mask["x"] is held
    assert (message.value_bytes, message.index_bytes) == (1 + 8, 1)


def test_quantized_constant_tensor_is_exact():
    x = torch.full((4,), 0.3)
    assert torch.equal(QuantizedCodec().encode({"x": x}, None, sender=0, masked_names=[]).weights["x"], x)


# -- arguments, registry, state --------------------------------------------------------------
@pytest.mark.parametrize("build, match", [
    (lambda: TopKCodec(0), r"ratio must be a number in \(0, 1\], got 0"),
    (lambda: RandomKCodec(1.5), r"ratio .* got 1.5"),
    (lambda: TopKCodec(float("nan")), r"ratio .* got nan"),
    (lambda: QuantizedCodec(bits=0), r"bits must be an integer in \[1, 32\], got 0"),
    (lambda: QuantizedCodec(bits=33), r"bits .* got 33"),
    (lambda: DenseCodec(bytes_per_value=0), r"bytes_per_value must be an integer >= 1, got 0"),
    (lambda: TopKCodec(0.5, bytes_per_index=-1), r"bytes_per_index .* got -1"),
    (lambda: MaskedCodec(send_mask="yes"), r"send_mask must be True or False, got 'yes'"),
    (lambda: build_codec("gzip"), r"unknown codec 'gzip'; allowed: masked, dense, top_k, random_k, quantized, gsgd"),
])
def test_bad_arguments_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_random_draws_need_a_generator():
    weights, mask = tiny_model()
    with pytest.raises(ValueError, match="'random_k' codec needs a torch.Generator"):
        RandomKCodec(0.5).encode(weights, mask, sender=0, masked_names=MASKED)
    with pytest.raises(ValueError, match="stochastic=True needs a torch.Generator"):
        QuantizedCodec(stochastic=True).encode(weights, mask, sender=0, masked_names=MASKED)


def test_registry_builds_each_codec():
    assert set(CODECS) == {"masked", "dense", "top_k", "random_k", "quantized", "gsgd"}
    codec = build_codec("top_k", ratio=0.25, bytes_per_index=2)
    assert isinstance(codec, TopKCodec) and (codec.ratio, codec.bytes_per_index) == (0.25, 2)
    assert codec.state_dict() == {}
    codec.load_state_dict({})
    with pytest.raises(ValueError, match="holds no state"):
        codec.load_state_dict({"residual": torch.zeros(1)})


# -- one registry: every algorithm's codec comes from messages.CODECS ----------------------------------
def test_gsgd_is_in_the_registry():
    codec = build_codec("gsgd", bits=5, noise="normal")
    assert isinstance(codec, GSGDCodec) and (codec.bits, codec.noise) == (5, "normal")


def test_choose_codec_takes_the_settings_each_codec_knows():
    allowed = ("gsgd", "top_k", "identity")
    assert isinstance(choose_codec("identity", allowed, bits=9, ratio=0.2), DenseCodec)  # an alias of dense
    top = choose_codec("top_k", allowed, bits=9, ratio=0.2, noise="uniform")
    assert isinstance(top, TopKCodec) and (top.ratio, top.bytes_per_index) == (0.2, 4)
    fixed = choose_codec("random_k", {"random_k": {"bytes_per_index": 0}}, ratio=0.5)
    assert isinstance(fixed, RandomKCodec) and fixed.bytes_per_index == 0
    with pytest.raises(ValueError, match="unknown compressor 'quantized'; allowed: gsgd, top_k, identity"):
        choose_codec("quantized", allowed, "compressor")


def test_algorithms_choose_their_codecs_from_the_registry():
    from lightning_dfl.federation.algorithms.beer import BEER
    from lightning_dfl.federation.algorithms.gossipfl import GossipFL

    assert masked_codec(True) is masked_codec(True) and masked_codec(True).send_mask
    assert not masked_codec(False).send_mask
    for compressor in ("gsgd", "top_k", "random_k", "identity"):
        codec = BEER(compressor=compressor)._codec
        assert type(codec) is CODECS[{"identity": "dense"}.get(compressor, compressor)]
    assert GossipFL(compressor="random_k")._codec.bytes_per_index == 0
    assert GossipFL(compressor="top_k")._codec.bytes_per_index == 4
