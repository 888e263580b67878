"""fsdp.optim.muon: the math against independent references (torch.optim.Muon, torch.optim.AdamW, an
SVD-based Newton–Schulz), and Owned-placement training equal to single-device training bit for
bit (gloo world 2, threaded world 4)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from dbuffer import DBuffer, Owned, distribute_tensors
from fsdp.optim.muon import NS_COEFFICIENTS, Muon, newton_schulz
from tests.harness import run_ranks

# ----------------------------------------------------------------------------- the math, one device


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (6, 6), (1, 7)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_matrices_step_like_torch_muon(shape, nesterov, adjust_lr) -> None:
    """torch.optim.Muon runs Newton–Schulz in bf16; with ns_dtype=bf16 ours is the same
    algorithm, so the weights agree bit for bit."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g)
    ours, ref = w.clone().requires_grad_(), w.clone().requires_grad_()
    opt = Muon([ours], lr=0.05, weight_decay=0.1, nesterov=nesterov, ns_dtype=torch.bfloat16, adjust_lr=adjust_lr)
    ref_opt = torch.optim.Muon([ref], lr=0.05, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr)
    for _ in range(4):
        grad = torch.randn(shape, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        assert torch.equal(ours, ref)
    assert not torch.equal(ours, w)


@pytest.mark.parametrize("shape", [(7,), (3, 4, 5), ()])
def test_other_tensors_step_like_torch_adamw(shape) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(shape, generator=g)
    ours, ref = w.clone().requires_grad_(), w.clone().requires_grad_()
    hp = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = Muon([ours], adamw_lr=1e-2, adamw_betas=hp["betas"], adamw_eps=hp["eps"], adamw_weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False, **hp)
    for _ in range(6):
        grad = torch.randn(shape, generator=g)
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
        assert torch.equal(ours, ref)


def test_use_muon_false_sends_a_matrix_to_adamw() -> None:
    w = torch.randn(4, 3)
    ours, ref = w.clone().requires_grad_(), w.clone().requires_grad_()
    opt = Muon([{"params": [ours], "use_muon": False}], adamw_lr=1e-2)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    grad = torch.randn(4, 3)
    ours.grad, ref.grad = grad.clone(), grad.clone()
    opt.step()
    ref_opt.step()
    assert torch.equal(ours, ref) and "exp_avg" in opt.state[ours]


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (7, 7)])
def test_fp32_newton_schulz_maps_singular_values_by_the_quintic(shape) -> None:
    """Newton–Schulz keeps the singular vectors and maps each normalised singular value s by
    s -> a s + b s^3 + c s^5: compare with that map applied to an fp64 SVD."""
    m = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    u, s, vh = torch.linalg.svd(m.double(), full_matrices=False)
    x = s / s.norm()  # the Frobenius norm is the 2-norm of the singular values
    a, b, c = NS_COEFFICIENTS
    for _ in range(5):
        x = a * x + b * x**3 + c * x**5
    expected = u @ torch.diag(x) @ vh
    got = newton_schulz(m)
    assert got.dtype == torch.float32 and got.shape == m.shape
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2e-5)
    singular = torch.linalg.svdvals(got.double())
    assert 0.6 < singular.min() and singular.max() < 1.25  # near 1: an approximate orthogonalisation


def test_bad_options_and_parameters_raise() -> None:
    w, v = torch.zeros(3, 2, requires_grad=True), torch.zeros(3, requires_grad=True)
    cases = [
        (lambda: Muon([w], lr=-1), r"lr=-1 is invalid; use a number >= 0"),
        (lambda: Muon([w], momentum=1.0), r"momentum=1.0 is invalid; use a number in \[0, 1\)"),
        (lambda: Muon([w], ns_steps=0), r"ns_steps=0 is invalid"),
        (lambda: Muon([w], adamw_betas=(0.9,)), r"adamw_betas"),
        (lambda: Muon([w], ns_dtype=torch.int32), r"ns_dtype"),
        (lambda: Muon([w], adjust_lr="spectral"), r"adjust_lr='spectral' is invalid"),
        (lambda: Muon([{"params": [w, v], "use_muon": True}]), r"param group 0 has use_muon=True but params\[1\] has shape \(3,\)"),
        (lambda: Muon([{"params": [w], "use_muon": "yes"}]), r"use_muon"),
        (lambda: newton_schulz(torch.zeros(2, 2, 2)), r"2-D matrix"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()


# ----------------------------------------------------------------------------- DTensor parameters

SHAPES = [(32, 12), (32,), (24, 32), (24,), (5, 24), (5,)]  # three Linear layers: a tall, a wide matrix
GLOBAL_BATCH = 32
STEPS = 5
HP = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01, adamw_lr=1e-3, adamw_weight_decay=0.01)


def _init() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) / (s[-1] ** 0.5 if len(s) == 2 else 4.0) for s in SHAPES]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 12, generator=g)
    return x, torch.sin(x[:, :5] * 2) + 0.1 * torch.randn(GLOBAL_BATCH, 5, generator=g)


def _forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w0, b0, w1, b1, w2, b2 = params
    return F.linear(torch.tanh(F.linear(torch.tanh(F.linear(x, w0, b0)), w1, b1)), w2, b2)


def _train_owned_against_single_device() -> dict:
    """Owned Muon training vs single-device Muon on the same global batch; compares every weight
    before every step and after the last, and returns the largest differences seen.

    Distributed: the Owned main weights are all-gathered into a reused full buffer for forward,
    each rank computes the mean loss over its slice (``GLOBAL_BATCH / world`` rows, rank order),
    its gradients go into a ``Partial("avg")`` buffer that is reduce-scattered to the owners, and
    Muon steps each tensor on its owner only.

    Reference, on this same process (same threads, same kernels): the global batch as ``world``
    micro-batches, the same slices, each micro-batch's mean loss scaled by ``1 / world`` and its
    gradients accumulated in rank order (autograd sums into ``.grad``), then one Muon step.

    Why the two agree bit for bit in fp32:

    * The forward and backward of micro-batch r are the same operations on the same values and
      shapes as rank r's (dbuffer's views hold the weights bit for bit).
    * Scaling the loss by ``1 / world`` scales every backward operation's result by exactly
      ``1 / world``: backward is linear in the incoming gradient, and multiplying by a power of
      two commutes with rounding (barring overflow and subnormals, which these values are far
      from). So micro-batch r contributes exactly ``g_r / world``, where ``g_r`` is rank r's
      gradient, and the accumulated ``((g_0/w + g_1/w) + g_2/w) + g_3/w`` equals
      ``(((g_0 + g_1) + g_2) + g_3) / w``.
    * That is what ``Partial("avg") -> Owned()`` computes. dbuffer/collectives.py: on gloo, below
      2 MiB per shard (these shards are under 4 KiB), reduce-scatter is an all-to-all followed by
      ``torch.add(rows[0], rows[1])`` and ``add_(rows[j])`` for j = 2.. in rank order, then
      ``div_(world)`` (gloo has no native average). On torch's threaded group, ``ReduceAvg`` is
      native: its ReduceScatter copies rank 0's chunk, ``add_``s ranks 1, 2, 3 in order and then
      ``div_``s by the group size: the same sums. (From 2 MiB gloo goes point to point, summing
      from the own rank backwards; for world 2 that is the same single sum, a + b = b + a.)
    * Muon's step is per tensor, on the whole tensor on its owner, with the same operations as on
      one device: the Newton–Schulz matmuls act on fresh tensors of identical values and shapes.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    init = _init()
    weights = distribute_tensors(init, mesh, [Owned()])  # the main weights: each on its owner
    full = DBuffer(mesh, [Replicate()], SHAPES, torch.float32, layout=weights.layout)
    grads_partial = DBuffer(mesh, [Partial("avg")], SHAPES, torch.float32, layout=weights.layout)
    grads = DBuffer(mesh, [Owned()], SHAPES, torch.float32)
    main = [torch.nn.Parameter(weights.get_dtensor(i)) for i in range(len(SHAPES))]
    for i, p in enumerate(main):
        p.grad = grads.get_dtensor(i)  # views: the reduce-scatter writes the grads in place
    opt = Muon(main, **HP)
    compute = [torch.nn.Parameter(torch.empty(0)) for _ in SHAPES]
    for i, p in enumerate(compute):
        p.data = full.get_local_tensor(i)  # forward runs on views of the gathered buffer

    ref = [t.clone().requires_grad_() for t in init]
    ref_opt = Muon(ref, **HP)
    x, y = _data()
    per = GLOBAL_BATCH // world
    gaps: list[float] = []

    def compare() -> None:
        weights.allgather(0, out=full)  # Owned -> Replicate
        gap = max((full.get_local_tensor(i) - r).abs().max().item() for i, r in enumerate(ref))
        exact = all(torch.equal(full.get_local_tensor(i), r) for i, r in enumerate(ref))
        gaps.append(0.0 if exact else max(gap, float.fromhex("0x1p-149")))

    for _ in range(STEPS):
        compare()
        for p in compute:
            p.grad = None
        mine = slice(rank * per, (rank + 1) * per)
        F.mse_loss(_forward(compute, x[mine]), y[mine]).backward()
        for i, p in enumerate(compute):
            grads_partial.get_local_tensor(i).copy_(p.grad)
        grads_partial.reduce_scatter(0, out=grads)  # Partial("avg") -> Owned: mean on the owner
        opt.step()

        for p in ref:
            p.grad = None
        for r in range(world):  # micro-batches in rank order, loss scaled by 1/world
            rows = slice(r * per, (r + 1) * per)
            (F.mse_loss(_forward(ref, x[rows]), y[rows]) / world).backward()
        ref_opt.step()
    compare()
    owned = [i for i in range(len(SHAPES)) if weights.owner(i) == rank]
    # every rank has state for every parameter (DCP needs the same keys everywhere), but only
    # the owner's has elements
    assert all(opt.state.get(p) for p in main)
    stepped = sorted(
        i for i, p in enumerate(main) if any(v.to_local().numel() for v in opt.state[p].values() if torch.is_tensor(v))
    )
    moved = max((r.detach() - t).abs().max().item() for r, t in zip(ref, init))
    return {"gaps": gaps, "owned": owned, "stepped": stepped, "moved": moved}


@pytest.mark.parametrize("backend,world", [("gloo", 2), ("threaded", 4)])
def test_owned_muon_equals_single_device_bit_for_bit(backend, world) -> None:
    results = run_ranks(_train_owned_against_single_device, world, backend=backend)
    for rank, res in enumerate(results):
        assert res["gaps"] == [0.0] * (STEPS + 1), (rank, res["gaps"])
        assert res["stepped"] == res["owned"]  # a rank's state has elements for what it owns
        assert res["moved"] > 1e-3  # the weights really changed
    assert sorted(i for res in results for i in res["owned"]) == list(range(len(SHAPES)))
    assert sum(bool(res["owned"]) for res in results) >= 2  # ownership is really spread


def _row_sharded_matrix_raises() -> bool:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weights = distribute_tensors([torch.ones(8, 4)], mesh, [Shard(0)])  # rows split over ranks
    p = torch.nn.Parameter(weights.get_dtensor(0))
    p.grad = weights.get_dtensor(0).clone()
    with pytest.raises(ValueError, match=r"holds 4 of the 8 rows.*Owned\(\)"):
        Muon([p]).step()
    q = torch.nn.Parameter(weights.get_dtensor(0))
    q.grad = torch.zeros(8, 4)
    with pytest.raises(TypeError, match=r"grad is a Tensor"):
        Muon([q]).step()
    return True


def test_row_sharded_matrix_raises() -> None:
    assert all(run_ranks(_row_sharded_matrix_raises, 2, backend="threaded"))


def test_lr_zero_freezes_both_parts_and_schedulers_scale_both() -> None:
    """torch.distributed.checkpoint initialises an empty optimizer by stepping it with lr=0; that
    must not move any weight (AdamW's weight decay included). An lr scheduler sets ``lr`` only;
    the AdamW part follows it."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(6, 4, generator=g).requires_grad_(), torch.randn(6, generator=g).requires_grad_()
    before = (w.detach().clone(), b.detach().clone())
    opt = Muon([w, b], lr=0.02, weight_decay=0.1, adamw_lr=1e-2, adamw_weight_decay=0.1)
    _init_optim_state(opt)
    assert torch.equal(w, before[0]) and torch.equal(b, before[1]) and opt.state[b]["step"] == 1
    ours, theirs = before[1].clone().requires_grad_(), before[1].clone().requires_grad_()
    halved = Muon([ours], lr=0.02, adamw_lr=1e-2)
    halved.param_groups[0]["lr"] = 0.01  # what a scheduler halving the lr does
    ref = torch.optim.AdamW([theirs], lr=5e-3, weight_decay=0.0, foreach=False)
    ours.grad, theirs.grad = torch.ones(6), torch.ones(6)
    halved.step()
    ref.step()
    assert torch.equal(ours, theirs)
