"""The study's format lab: its quantizers keep their stated formats, and its default reproduces
loco's all-reduce bit for bit inside DDP training (what makes its other formats' losses
comparable with loco's)."""

from __future__ import annotations

import pytest
import torch

from lowbitcc.codec import reference
from lowbitcc.tools.study.formats import (
    E4M3_MAX,
    FP3,
    FP3_E2M0,
    FP4_E2M1,
    INT3,
    INT3_MX,
    INT6,
    LAB_VARIANTS,
    MXFP4,
    NVFP4,
    NVFP4_SR,
    Format,
    Stage,
    hadamard,
    round_up_e4m3,
)


def _groups(g: int, n: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, g, generator=gen) * torch.rand(n, 1, generator=gen) ** 4


def test_int4_fp32_is_loco_reference_bit_for_bit():
    y = _groups(128)
    codes, scales = reference.quantize(y, 4)
    assert torch.equal(Format().roundtrip(y), reference.dequantize(codes, scales))


@pytest.mark.parametrize("fmt", [Format(group=64, scale="bf16"), Format(group=32, scale="e8m0"),
                                 Format("fp4", group=32, scale="e8m0"),
                                 Format("fp4", group=64, scale="bf16")])
def test_values_lie_on_the_format_grid(fmt):
    y = _groups(fmt.group)
    d = fmt.roundtrip(y)
    amax = y.abs().amax(dim=1, keepdim=True)
    top = 6.0 if fmt.codes == "fp4" else 7.0
    scale = amax / top
    if fmt.scale == "e8m0":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))
    else:  # bf16, rounded up: representable, and never below the exact scale
        b = scale.to(torch.bfloat16)
        up = (b.view(torch.int16) + 1).view(torch.bfloat16)  # the next bf16 above
        scale = torch.where(b.float() < scale, up.float(), b.float())
    mags = (d / scale).abs()
    grid = FP4_E2M1 if fmt.codes == "fp4" else torch.arange(8.0)
    assert torch.isin(mags, grid).all()
    # nearest on the grid: the error is at most half the widest step near each value
    step = 2.0 if fmt.codes == "fp4" else 1.0
    assert ((d - y).abs() <= step / 2 * scale * (1 + 1e-6)).all()


def test_e4m3_scales_round_up_to_fp8_values():
    gen = torch.Generator().manual_seed(3)
    s = torch.exp2(torch.rand(10_000, generator=gen) * 17.7 - 9)  # 2^-9 .. 448
    r = round_up_e4m3(s)
    assert torch.equal(r.to(torch.float8_e4m3fn).float(), r)  # representable
    assert (r >= s).all() and (r <= E4M3_MAX).all()
    below = (r.to(torch.float8_e4m3fn).view(torch.uint8) - 1).view(torch.float8_e4m3fn).float()
    assert (below < s).all()  # the smallest such value: the one below is too small
    assert torch.equal(round_up_e4m3(torch.tensor([0.0, 1.0, 1.01, 448.0, 3e-3])),
                       torch.tensor([0.0, 1.0, 1.125, 448.0, 2 * 2.0 ** -9]))


def _nvfp4_scales(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's scales of groups ``y``: each group's E4M3 value (``[groups, 1]``) and the one
    fp32 scale of the whole call they multiply."""
    scales = y.abs().amax(dim=1, keepdim=True) / 6
    tensor_scale = scales.max() / E4M3_MAX
    return round_up_e4m3(scales / tensor_scale), tensor_scale


def test_nvfp4_values_lie_on_e2m1_codes_times_e4m3_scales():
    y = _groups(16, n=256)
    d = NVFP4.roundtrip(y)
    stored, tensor_scale = _nvfp4_scales(y)
    assert torch.equal(stored.to(torch.float8_e4m3fn).float(), stored)
    mags = (d / (stored * tensor_scale)).abs()
    nearest = FP4_E2M1[(mags.unsqueeze(-1) - FP4_E2M1).abs().argmin(-1)]
    assert torch.allclose(mags, nearest, atol=1e-5)  # E2M1 magnitudes
    assert ((d - y).abs() <= stored * tensor_scale * (1 + 1e-5)).all()  # half the widest step


@pytest.mark.parametrize("fmt", [INT3, FP3, INT6], ids=["int3", "fp3", "int6"])
def test_codes_under_e4m3_scales_lie_on_their_grid(fmt):
    """The 3-bit family and the 6-bit integer codes under NVFP4's scales: each value a sign
    and the nearest of the grid's magnitudes (int: 0 to ``2^(bits-1) - 1``, fp3: E2M0's 0, 1,
    2, 4) times the group's stored scale; fewer bits than NVFP4's 4 leave more error, more bits
    less."""
    y = _groups(16, n=256)
    d = fmt.roundtrip(y)
    grid = FP3_E2M0 if fmt.codes == "fp3" else torch.arange(2.0 ** (fmt.bits - 1))
    scales = y.abs().amax(dim=1, keepdim=True) / grid[-1]
    tensor_scale = scales.max() / E4M3_MAX
    scale = round_up_e4m3(scales / tensor_scale) * tensor_scale
    mags = (d / scale).abs()
    nearest = grid[(mags.unsqueeze(-1) - grid).abs().argmin(-1)]
    assert torch.allclose(mags, nearest, atol=1e-5)
    assert mags.max() <= grid[-1] * (1 + 1e-5)  # the largest code: no more than the bits hold
    widest = 2.0 if fmt.codes == "fp3" else 1.0  # half of it: the largest rounding error
    assert ((d - y).abs() <= widest / 2 * scale * (1 + 1e-5)).all()
    nvfp4 = (NVFP4.roundtrip(y) - y).norm()
    assert (d - y).norm() > nvfp4 if fmt.bits < 4 else (d - y).norm() < nvfp4 / 4


def test_hadamard_rotation_is_orthonormal_and_spreads_an_outlier():
    r = hadamard(32)
    assert torch.allclose(r @ r.T, torch.eye(32), atol=1e-6)
    assert torch.equal(hadamard(32), r)  # the same on every rank
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(64, 32, generator=gen) * 0.01
    y[:, 5] = 10.0  # one outlier per group: every other element quantizes to zero unrotated
    plain = Stage(MXFP4).roundtrip(y.reshape(-1), None)
    rotated = Stage(MXFP4, rotate=32).roundtrip(y.reshape(-1), None)
    assert (rotated - y.reshape(-1)).norm() < (plain - y.reshape(-1)).norm()
    exact = Stage(Format(bits=8, group=32), rotate=32).roundtrip(y.reshape(-1), None)
    assert torch.allclose(exact, y.reshape(-1), atol=0.1)  # rotated back


def test_bits_per_element():
    assert LAB_VARIANTS["lab-int4-g128"].bits_per_element == 4.25
    assert LAB_VARIANTS["lab-mxfp4"].bits_per_element == 4.25
    assert LAB_VARIANTS["lab-nvfp4"].bits_per_element == 4.5
    assert LAB_VARIANTS["lab-mxfp4-had32"].bits_per_element == 4.25
    assert LAB_VARIANTS["lab-mxfp4-ag8"].bits_per_element == (4.25 + 8.25) / 2
    assert LAB_VARIANTS["lab-asym4-g64-bf16"].bits_per_element == 4.5
    assert LAB_VARIANTS["lab-rs-only"].bits_per_element == (4.25 + 32) / 2
    assert LAB_VARIANTS["lab-int3"].bits_per_element == LAB_VARIANTS["lab-fp3"].bits_per_element
    assert LAB_VARIANTS["lab-fp3-nofb"].bits_per_element == 3.5 and INT3.bits_per_element == 3.5
    assert LAB_VARIANTS["lab-int3-mx"].bits_per_element == INT3_MX.bits_per_element == 3.25
    assert LAB_VARIANTS["lab-int6-nofb"].bits_per_element == INT6.bits_per_element == 6.5
    with pytest.raises(ValueError, match="fp3 codes are 3 bits"):
        Format("fp3", bits=4)


def test_stochastic_rounding_on_the_fp4_grid_is_unbiased_between_neighbours():
    y = _groups(16)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([NVFP4_SR.roundtrip(y, gen) for _ in range(2000)])
    nearest = NVFP4.roundtrip(y)
    stored, tensor_scale = _nvfp4_scales(y)
    scale = stored * tensor_scale
    mags = (draws / scale).abs()
    on_grid = FP4_E2M1[(mags.unsqueeze(-1) - FP4_E2M1).abs().argmin(-1)]
    assert torch.allclose(mags, on_grid, atol=1e-5)  # E2M1 magnitudes
    # each draw is one of the two grid values around the value (the same one where it is on it)
    v = (y / scale).abs()
    below = (torch.bucketize(v, FP4_E2M1, right=True) - 1).clamp(0, 6)
    assert ((on_grid == FP4_E2M1[below]) | (on_grid == FP4_E2M1[below + 1])).all()
    # unbiased: the mean of the draws is the value (nearest's error is not: it repeats)
    bias = (draws.mean(0) - y).abs().mean() / y.abs().mean()
    assert bias < 0.01 < (nearest - y).abs().mean() / y.abs().mean()
    assert not torch.equal(draws[0], draws[1])
    with pytest.raises(ValueError, match="rounds to nearest"):
        Format("fp4", group=32, scale="e8m0", stochastic=True)


def test_asymmetric_codes_cover_the_group_range():
    y = _groups(64) + 0.5  # mostly positive groups: where min/max codes gain a bit
    d = Format("asym", group=64, scale="bf16").roundtrip(y)
    sym = Format(group=64, scale="bf16").roundtrip(y)
    assert (d - y).norm() < (sym - y).norm()


def _train_each(rank: int, world: int, fmt: str) -> dict[str, list[torch.Tensor]]:
    """`_train` of loco, lab and exact, one after the other in the same ranks."""
    return {which: _train(rank, world, which, fmt) for which in ("loco", "lab", "exact")}


def _train(rank: int, world: int, which: str, fmt: str = "int") -> list[torch.Tensor]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lowbitcc
    from lowbitcc.tools.study.formats import LabState, lab_hook
    from lowbitcc.tools.study.model import TinyGPT, lm_loss, optimizer, split_corpus, train_batches
    from lowbitcc.tools.study.variants import QUICK, StudyConfig

    cfg = StudyConfig(steps=4, **QUICK)
    train, _ = split_corpus(cfg)
    torch.manual_seed(0)
    group = None
    if which == "loco":
        group = dist.new_group(backend="loco", pg_options=lowbitcc.LocoConfig(
            cost_model=False, format=fmt))
    model = DDP(TinyGPT(cfg), process_group=group)
    if which == "lab":
        lab = {"int": "lab-int4-g128", "mxfp4": "lab-mxfp4"}[fmt]
        model.register_comm_hook(LabState(LAB_VARIANTS[lab], 0), lab_hook)
    opt, sched = optimizer(model.parameters(), cfg)
    out = []
    for x, y in train_batches(train, cfg, 0, rank):
        loss = lm_loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return out


@pytest.mark.parametrize("fmt", [pytest.param("int", marks=pytest.mark.slow), "mxfp4"])
def test_lab_trains_bit_for_bit_like_loco(fmt):
    """lab-int4-g128 against loco with int4 / 128, lab-mxfp4 against loco's MXFP4 (with feedback)."""
    from lowbitcc.tools.spawn import run_ranks

    runs = run_ranks(_train_each, 2, fmt, backend="gloo")[0]
    loco, lab, exact = runs["loco"], runs["lab"], runs["exact"]
    assert len(loco) == len(lab) == 4
    for a, b in zip(loco, lab):
        assert torch.equal(a, b)
    assert not torch.equal(loco[-1], exact[-1])  # compression did change the weights


class _Bucket:
    """What `lab_hook` reads of DDP's GradBucket."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer


def _rebuilt_bucket_at_the_same_address(rank: int, world: int) -> tuple[bool, bool]:
    from lowbitcc.tools.study.formats import LabState, lab_hook

    n = 1 << 17
    lab, fresh = LabState(LAB_VARIANTS["lab-mxfp4"], 0), LabState(LAB_VARIANTS["lab-mxfp4"], 0)
    # two storages over one piece of memory: what DDP's rebuilt bucket is when the allocator
    # places it where the freed old one was (it does, now and then)
    memory = bytearray(4 * n)
    old = torch.frombuffer(memory, dtype=torch.float32)
    old.copy_(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    lab_hook(lab, _Bucket(old)).wait()
    new = torch.frombuffer(memory, dtype=torch.float32)
    new.copy_(torch.randn(n, generator=torch.Generator().manual_seed(2)))
    same_address = new.data_ptr() == old.data_ptr()
    copy = new.clone()
    lab_hook(lab, _Bucket(new)).wait()
    lab_hook(fresh, _Bucket(copy)).wait()
    return same_address, torch.equal(new, copy)


def test_lab_resets_a_rebuilt_bucket_even_at_the_old_buckets_address():
    """A bucket in new storage starts from zero error, as in loco, also where the allocator
    put it at the freed bucket's address (the lab compared addresses and kept the old
    layout's errors there)."""
    from lowbitcc.tools.spawn import run_ranks

    same_address, like_fresh = run_ranks(_rebuilt_bucket_at_the_same_address, 1,
                                         backend="gloo", timeout_s=60)[0]
    assert same_address
    assert like_fresh
