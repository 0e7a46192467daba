import pytest
import torch

from lightning_dfl.federation import masked_average


def test_masked_average_matches_hand_computed_eq7():
    # three sources, one masked 2x2 weight and one unmasked bias
    w = torch.tensor([[[1.0, 2.0], [0.0, 4.0]],
                      [[3.0, 0.0], [0.0, 8.0]],
                      [[5.0, 6.0], [0.0, 0.0]]])
    m = torch.tensor([[[1, 1], [0, 1]],
                      [[1, 0], [0, 1]],
                      [[1, 1], [0, 0]]], dtype=torch.bool)
    b = torch.tensor([[1.0], [2.0], [6.0]])
    receiver = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    out = masked_average({"w": w, "b": b}, {"w": m}, receiver_mask={"w": receiver})
    # (1+3+5)/3, (2+6)/2, nobody holds [1,0] -> 0, [1,1] masked out by the receiver
    assert torch.allclose(out["w"], torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    assert torch.allclose(out["b"], torch.tensor([3.0]))


def test_regrown_weight_takes_neighbours_average():
    # the receiver's own model does not hold entry 1 (it was regrown), a neighbour does
    w = torch.tensor([[2.0, 0.0], [4.0, 10.0]])
    m = torch.tensor([[True, False], [True, True]])
    out = masked_average({"w": w}, {"w": m}, receiver_mask={"w": torch.tensor([True, True])})
    assert torch.allclose(out["w"], torch.tensor([3.0, 10.0]))


def test_weighted_average_is_fedavg_on_dense_masks():
    w = torch.tensor([[1.0, 1.0], [4.0, 7.0]])
    m = torch.ones(2, 2, dtype=torch.bool)
    out = masked_average({"w": w}, {"w": m}, coefficients=[1.0, 2.0])
    assert torch.allclose(out["w"], torch.tensor([3.0, 5.0]))


def test_bad_coefficients_are_refused():
    w = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        masked_average({"w": w}, {}, coefficients=[1.0, -1.0])
    with pytest.raises(ValueError, match="2 non-negative"):
        masked_average({"w": w}, {}, coefficients=[1.0])
