"""The round's one host read: every field packed by :class:`RoundReadout` comes back by name, with and without
the policy's estimates and aux columns, floats bit for bit."""
import pytest
import torch

from taps.decode.readout import RoundReadout


def _fields(B=3, P=4, A=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    committed = torch.randint(-1, 50000, (B, P), generator=g)
    accept_len = torch.randint(0, P + 1, (B,), generator=g)
    next_nodes = torch.randint(1, 65, (B,), generator=g).to(torch.int32)
    root_ok = torch.rand(B, generator=g) > 0.3
    expected = torch.rand(B, generator=g) * 7 + 1
    sizes = torch.randint(0, 64, (B,), generator=g)
    aux = torch.randint(-5, 10 ** 6, (B, A), generator=g)
    return committed, accept_len, next_nodes, root_ok, expected, sizes, aux


@pytest.mark.parametrize("estimates,with_aux", [(False, False), (True, False), (False, True), (True, True)])
def test_every_field_comes_back_by_name(estimates, with_aux):
    committed, accept_len, next_nodes, root_ok, expected, sizes, aux = _fields()
    r = RoundReadout(committed, accept_len, next_nodes, root_ok, expected if estimates else None,
                     sizes if estimates else None, aux if with_aux else None)
    h = r.read()
    assert h.committed == committed.tolist() and h.accept_len == accept_len.tolist()
    assert h.next_nodes == next_nodes.tolist() and h.root_ok == root_ok.tolist()
    assert [h.tokens(b) for b in range(3)] == [committed[b, :int(accept_len[b])].tolist() for b in range(3)]
    if estimates:
        assert h.expected == expected.double().tolist()  # float32 -> float64 exactly, no rounding in the bits
        assert h.sizes == sizes.tolist()
    else:
        assert h.expected is None and h.sizes is None
    assert h.aux == (aux.tolist() if with_aux else None)


def test_estimates_come_in_pairs():
    committed, accept_len, next_nodes, root_ok, expected, sizes, _ = _fields()
    with pytest.raises(ValueError, match="expected and sizes"):
        RoundReadout(committed, accept_len, next_nodes, root_ok, expected, None)
