import pytest
import torch

from tritile.engram import engram_hash
from tritile.testing import assert_equal, generate_num_tokens
from tritile.torch.engram import engram_hash_ref, make_offsets


def _data(T, N, L, E, device, wide=False):
    if wide:  # overflowing int64 products, negative ids and hashes, huge tables
        ids = torch.randint(-2 ** 31, 2 ** 31 - 1, (T, N), dtype=torch.int32, device=device)
        mult = torch.randint(-2 ** 63, 2 ** 63 - 1, (L, N), dtype=torch.int64, device=device)
        vocab = torch.randint(1, 2 ** 31 - 1, (L, N - 1, E), dtype=torch.int32, device=device)
    else:  # TileKernels' test data
        ids = torch.randint(0, 100000, (T, N), dtype=torch.int32, device=device)
        mult = torch.randint(0, 100000, (L, N), dtype=torch.int64, device=device)
        vocab = torch.randint(100000, 1000000, (L, N - 1, E), dtype=torch.int32, device=device)
    return ids, mult, vocab, make_offsets(vocab)


@pytest.mark.parametrize("T", generate_num_tokens(cpu=(0, 1, 33, 1500)))
@pytest.mark.parametrize("wide", [False, True])
def test_engram_hash(device, T, wide):
    ids, mult, vocab, offsets = _data(T, 3, 2, 8, device, wide)
    out = engram_hash(ids, mult, vocab, offsets)
    assert_equal(out, engram_hash_ref(ids, mult, vocab, offsets))
    assert out.shape == (2, T, 16) and out.is_contiguous()


@pytest.mark.parametrize("N,L,E", [(2, 1, 1), (4, 3, 5), (5, 2, 16), (1, 2, 8)])
def test_engram_hash_shapes(device, N, L, E):
    ids, mult, vocab, offsets = _data(57, N, L, E, device, wide=True)
    ids_strided = torch.randint(-9, 9, (57, N + 3), dtype=torch.int32, device=device)[:, 1:N + 1]
    ids_strided.copy_(ids)
    out = engram_hash(ids_strided, mult, vocab, offsets)
    assert_equal(out, engram_hash_ref(ids, mult, vocab, offsets))


def test_engram_hash_edges(device):
    # the floor-mod with negative hashes and the wrapping int32 add, on hand-picked values
    ids = torch.tensor([[-7, 0], [7, 1], [-1, -1], [2 ** 31 - 1, -2 ** 31]], dtype=torch.int32, device=device)
    mult = torch.tensor([[1, 1], [2 ** 62, 3]], dtype=torch.int64, device=device)
    vocab = torch.tensor([[[3, 2 ** 31 - 1]], [[5, 1]]], dtype=torch.int32, device=device)
    offsets = torch.tensor([[2 ** 31 - 2, 0], [-5, 7]], dtype=torch.int32, device=device)
    out = engram_hash(ids, mult, vocab, offsets)
    assert_equal(out, engram_hash_ref(ids, mult, vocab, offsets))
    # layer 0, token 0: h = (-7) ^ 0 = -7; -7 floor-mod 3 = 2; 2 + (2^31 - 2) wraps to -2^31
    assert int(out[0, 0, 0]) == -2 ** 31


def test_make_offsets(device):
    vocab = torch.tensor([[[3, 4], [5, 6]], [[2 ** 30, 2 ** 30], [2 ** 30, 1]]], dtype=torch.int32, device=device)
    off = make_offsets(vocab)
    assert off.dtype == torch.int32 and off.shape == (2, 4)
    assert off[0].tolist() == [0, 3, 7, 12]
    assert off[1].tolist() == [0, 2 ** 30, -2 ** 31, -2 ** 30]  # int32 wrap


def test_engram_hash_bad_inputs(device, monkeypatch):
    ids, mult, vocab, offsets = _data(9, 3, 2, 8, device)
    with pytest.raises(TypeError, match="ngram_token_ids"):
        engram_hash(ids.long(), mult, vocab, offsets)
    with pytest.raises(TypeError, match="multipliers"):
        engram_hash(ids, mult.int(), vocab, offsets)
    with pytest.raises(TypeError, match="vocab_sizes"):
        engram_hash(ids, mult, vocab.long(), offsets)
    with pytest.raises(TypeError, match="offsets"):
        engram_hash(ids, mult, vocab, offsets.long())
    with pytest.raises(ValueError, match="multipliers must have shape"):
        engram_hash(ids, mult[:1], vocab, offsets)  # L disagrees with vocab_sizes
    with pytest.raises(ValueError, match="multipliers must have shape"):
        engram_hash(ids[:, :2], mult, vocab, offsets)  # N disagrees
    with pytest.raises(ValueError, match="vocab_sizes must have shape"):
        engram_hash(ids, mult, vocab[:, :1], offsets)
    with pytest.raises(ValueError, match="offsets must have shape"):
        engram_hash(ids, mult, vocab, offsets[:, :8])
    with pytest.raises(ValueError, match="ngram_token_ids must be 2D"):
        engram_hash(ids[0], mult, vocab, offsets)
    with pytest.raises(ValueError, match="ngram_token_ids must have a unit stride"):
        engram_hash(ids.t().contiguous().t(), mult, vocab, offsets)
    with pytest.raises(ValueError, match="vocab_sizes must be contiguous"):
        engram_hash(ids, mult, vocab.transpose(1, 2).contiguous().transpose(1, 2), offsets)
    if device.type == "cuda":  # no host sync by default: non-positive sizes give -1; TRITILE_CHECKS=1 raises
        bad = vocab.clone()
        bad[1, 0, 3] = 0
        out = engram_hash(ids, mult, bad, offsets)
        assert (out[1, :, 3] == -1).all()
        monkeypatch.setenv("TRITILE_CHECKS", "1")
    for value in (0, -5):
        bad = vocab.clone()
        bad[1, 0, 3] = value
        with pytest.raises(ValueError, match="vocab_sizes must be > 0"):
            engram_hash(ids, mult, bad, offsets)


def test_engram_hash_gpu_like_blocks(device, monkeypatch):
    import tritile.engram.engram_hash_kernel as hm

    monkeypatch.setattr(hm, "_config", lambda T: 16)
    ids, mult, vocab, offsets = _data(57, 3, 2, 8, device, wide=True)
    assert_equal(engram_hash(ids, mult, vocab, offsets), engram_hash_ref(ids, mult, vocab, offsets))


def test_engram_hash_opcheck_and_compile(device):
    import tritile.engram.engram_hash_kernel as hm

    ids, mult, vocab, offsets = _data(20, 3, 2, 8, device, wide=True)
    torch.library.opcheck(hm._engram_hash_op.op, (ids, mult, vocab, offsets))
    f = torch.compile(engram_hash, backend="eager", fullgraph=True)
    assert_equal(f(ids, mult, vocab, offsets), engram_hash_ref(ids, mult, vocab, offsets))
