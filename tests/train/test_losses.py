import pytest
import torch
import torch.nn.functional as F

from kiln.train.losses import (
    LOSSES, BCEWithLogits, CrossEntropy, Huber, Loss, MSE, NTXent, as_loss, from_callable,
)

F64 = dict(dtype=torch.float64)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _mean(loss, output, target):
    return loss(output, target) / loss.count(target)


def _close(a, b, tol=1e-12):
    torch.testing.assert_close(a, torch.as_tensor(b, **F64), rtol=tol, atol=tol)


# --- each loss against torch's mean reduction -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (7, 3), (5, 2, 4)])
def test_regression_losses_match_torch_mean(shape):
    g = _gen(1)
    out, tgt = torch.randn(shape, generator=g, **F64) * 2, torch.randn(shape, generator=g, **F64) * 2
    bits = torch.rand(shape, generator=g, **F64)  # BCE targets may be soft
    _close(_mean(MSE(), out, tgt), F.mse_loss(out, tgt))
    _close(_mean(Huber(0.7), out, tgt), F.huber_loss(out, tgt, delta=0.7))
    _close(_mean(BCEWithLogits(), out, bits), F.binary_cross_entropy_with_logits(out, bits))
    pw = torch.rand(shape[-1], generator=g, **F64) + 0.5
    _close(_mean(BCEWithLogits(pos_weight=pw), out, bits), F.binary_cross_entropy_with_logits(out, bits, pos_weight=pw))


def test_cross_entropy_matches_torch_class_dim_last():
    g = _gen(2)
    logits, tgt = torch.randn(3, 5, 11, generator=g, **F64), torch.randint(0, 11, (3, 5), generator=g)
    tgt[0, :2] = tgt[2, 4] = -100
    for eps in (0.0, 0.2):
        # torch wants the class dim second for (B, T, C): movedim is an independent route to the same numbers
        ref = F.cross_entropy(logits.movedim(-1, 1), tgt, label_smoothing=eps)
        _close(_mean(CrossEntropy(label_smoothing=eps), logits, tgt), ref)
    assert CrossEntropy().count(tgt).item() == 12 and CrossEntropy().count(tgt).dtype == torch.int64


def test_cross_entropy_label_smoothing_and_ignore_index_by_hand():
    g = _gen(3)
    n, c, eps, ignore = 9, 6, 0.15, 3  # a real class as ignore_index: those rows must drop out
    logits, tgt = torch.randn(n, c, generator=g, **F64) * 3, torch.randint(0, c, (n,), generator=g)
    tgt[tgt == ignore] = ignore + 1  # exactly two ignored rows, at 1 and 4
    tgt[[1, 4]] = ignore
    logp = logits - logits.exp().sum(1, keepdim=True).log()  # log-softmax written out
    total, kept = 0.0, 0
    for i in range(n):
        if tgt[i] == ignore:
            continue
        # smoothed target distribution: (1-eps) on the true class plus eps/C on every class
        q = torch.full((c,), eps / c, **F64)
        q[tgt[i]] += 1 - eps
        total, kept = total - (q * logp[i]).sum(), kept + 1
    loss = CrossEntropy(label_smoothing=eps, ignore_index=ignore)
    assert loss.count(tgt).item() == kept == n - 2
    _close(loss(logits, tgt), total)
    _close(loss(logits, tgt) / kept, F.cross_entropy(logits, tgt, label_smoothing=eps, ignore_index=ignore))


# --- NT-Xent ----------------------------------------------------------------------------------------------------


def _ntxent_naive(za, zb, temperature):
    """Anchor by anchor, no matrices: the SimCLR definition as written in the paper."""
    z = [v / v.norm() for v in list(za) + list(zb)]
    n2, total = len(z), torch.zeros((), **F64)
    for i in range(n2):
        pos = (i + n2 // 2) % n2
        denom = sum(torch.exp(z[i] @ z[k] / temperature) for k in range(n2) if k != i)
        total = total - torch.log(torch.exp(z[i] @ z[pos] / temperature) / denom)
    return total


@pytest.mark.parametrize("temperature", [0.1, 0.5, 2.0])
def test_ntxent_matches_naive_loop_and_is_symmetric(temperature):
    g = _gen(4)
    za, zb = torch.randn(5, 8, generator=g, **F64), torch.randn(5, 8, generator=g, **F64) * 3
    loss = NTXent(temperature)
    _close(loss(za, zb), _ntxent_naive(za, zb, temperature))
    _close(loss(zb, za), loss(za, zb))
    assert loss.count(zb).item() == 10


def test_ntxent_single_pair_has_no_negatives():
    za, zb = torch.randn(1, 4, **F64), torch.randn(1, 4, **F64)
    _close(NTXent()(za, zb), 0.0)  # the positive is the only candidate: probability 1


def test_ntxent_gradcheck():
    g = _gen(5)
    za = torch.randn(3, 4, generator=g, **F64, requires_grad=True)
    zb = torch.randn(3, 4, generator=g, **F64, requires_grad=True)
    assert torch.autograd.gradcheck(NTXent(0.3), (za, zb))


# --- accumulation: (3, 3, 1) micro-batches give the full-batch mean ---------------------------------------------


def _accumulated(loss, output, target, sizes=(3, 3, 1)):
    sums = [loss(o, t) for o, t in zip(output.split(sizes), target.split(sizes))]
    counts = [loss.count(t) for t in target.split(sizes)]
    return sum(sums) / sum(counts)


def test_accumulation_equals_full_batch_mean():
    g = _gen(6)
    out, tgt = torch.randn(7, 2, 3, generator=g, **F64), torch.randn(7, 2, 3, generator=g, **F64)
    bits = torch.rand(7, 2, 3, generator=g, **F64)
    _close(_accumulated(MSE(), out, tgt), F.mse_loss(out, tgt))
    _close(_accumulated(Huber(), out, tgt), F.huber_loss(out, tgt))
    _close(_accumulated(BCEWithLogits(), out, bits), F.binary_cross_entropy_with_logits(out, bits))

    # tokens (7, 4) over 5 classes; uneven ignores, and the last micro-batch (sample 6) entirely ignored
    logits, ids = torch.randn(7, 4, 5, generator=g, **F64), torch.randint(0, 5, (7, 4), generator=g)
    ids[0, 1] = ids[2, :3] = ids[4, 0] = ids[6] = -100
    for eps in (0.0, 0.1):
        ref = F.cross_entropy(logits.reshape(-1, 5), ids.reshape(-1), label_smoothing=eps)
        _close(_accumulated(CrossEntropy(label_smoothing=eps), logits, ids), ref)
    assert CrossEntropy()(logits[6:], ids[6:]).item() == 0.0  # all ignored: a zero sum, not NaN


def test_empty_micro_batch_is_zero():
    empty = torch.zeros(0, 3, **F64)
    _close(MSE()(empty, empty), 0.0)
    assert MSE().count(empty).item() == 0


# --- dtypes, as_loss, errors ------------------------------------------------------------------------------------


def test_half_precision_sums_in_fp32():
    g = _gen(7)
    logits, ids = torch.randn(6, 10, generator=g).bfloat16(), torch.randint(0, 10, (6,), generator=g)
    x, y = torch.randn(6, 3, generator=g).bfloat16(), torch.randn(6, 3, generator=g).bfloat16()
    for loss, o, t in [(CrossEntropy(0.1), logits, ids), (MSE(), x, y), (Huber(), x, y),
                       (BCEWithLogits(), x, y.sigmoid()), (NTXent(), x, y)]:
        s = loss(o, t)
        assert s.dtype == torch.float32 and s.ndim == 0, loss
    # the upcast happens before the math: equal to the fp32 computation on the same (bf16-rounded) values
    torch.testing.assert_close(CrossEntropy()(logits, ids), F.cross_entropy(logits.float(), ids, reduction="sum"))


def test_as_loss_names_callables_and_passthrough():
    for name, cls in LOSSES.items():
        loss = as_loss(name)
        assert type(loss) is cls and isinstance(loss, Loss)
    custom = Huber(2.0)
    assert as_loss(custom) is custom

    g = _gen(8)
    out, tgt = torch.randn(7, 3, generator=g, **F64), torch.randn(7, 3, generator=g, **F64)
    l1 = as_loss(F.l1_loss)
    assert "l1_loss" in repr(l1)
    _close(_accumulated(l1, out, tgt), F.l1_loss(out, tgt))
    _close(from_callable(F.l1_loss)(out, tgt), F.l1_loss(out, tgt, reduction="sum") / 3)  # per-sample means


def test_as_loss_rejects_with_help():
    with pytest.raises(ValueError, match=r"'mse'.*did you mean 'mse'") as e:
        as_loss("mse_")
    assert "cross_entropy" in str(e.value)
    with pytest.raises(TypeError, match="cannot make a loss from int.*count"):
        as_loss(3)


def test_reprs_show_settings():
    assert repr(CrossEntropy(0.1, -1)) == "CrossEntropy(label_smoothing=0.1, ignore_index=-1)"
    assert repr(Huber(0.5)) == "Huber(delta=0.5)" and repr(NTXent(0.2)) == "NTXent(temperature=0.2)"
    assert repr(BCEWithLogits(torch.tensor([2.0]))) == "BCEWithLogits(pos_weight=[2.0])" and repr(MSE()) == "MSE()"


@pytest.mark.parametrize("loss, out_shape, tgt_shape", [
    (MSE(), (8, 3), (8, 2)), (Huber(), (8, 3), (3, 8)), (BCEWithLogits(), (8,), (8, 1)),
    (CrossEntropy(), (8, 5), (8, 5)), (CrossEntropy(), (4, 5, 6), (4, 6)), (NTXent(), (8, 3), (7, 3)),
    (NTXent(), (8,), (8,)),
])
def test_shape_mismatch_names_both_shapes(loss, out_shape, tgt_shape):
    target = torch.zeros(tgt_shape, dtype=torch.int64 if isinstance(loss, CrossEntropy) else torch.float32)
    with pytest.raises(ValueError) as e:
        loss(torch.zeros(out_shape), target)
    assert str(out_shape) in str(e.value) and str(tgt_shape) in str(e.value), e.value


def test_bad_settings_raise():
    for make in (lambda: CrossEntropy(label_smoothing=1.5), lambda: Huber(0), lambda: NTXent(-1.0)):
        with pytest.raises(ValueError):
            make()
