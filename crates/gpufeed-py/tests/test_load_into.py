"""``gpufeed.load_into``: a checkpoint written into CUDA tensors the caller owns.

Without a GPU: the refusals that need none (CPU tensors, neither or both of ``tensors`` and
``model``, a URL, an empty dict under ``strict``). On a GPU (skipped with the reason without
torch or a GPU, a failure where ``GPUFEED_REQUIRE_GPU=1``): random tensors of every common
dtype at odd shapes, an empty one and an index of two shards written bit for bit into
preallocated tensors (against safetensors' own ``load_file``); a small staging that splits
tensors into pieces; ``model=`` with tied weights; missing and unexpected names with and
without ``strict``; dtype, shape and overlap mismatches refused with nothing written; device
memory beyond the destinations bounded by the staging (the driver's free memory); row and
column plans (tensor-parallel shares) bit for bit against safetensors' ``get_slice``, and bad
plans refused with nothing written. Without a GPU also the plan checks that need none. Casts
into destinations of another dtype: test_casts.py."""

import json
import os
import threading

import pytest

import gpufeed

REQUIRED = os.environ.get("GPUFEED_REQUIRE_GPU") == "1"


def _torch():
    try:
        import torch
    except ImportError as e:
        if REQUIRED:
            raise
        pytest.skip(f"torch is not installed ({e})")
    return torch


def _torch_on_gpu():
    torch = _torch()
    if not torch.cuda.is_available():
        if REQUIRED:
            raise AssertionError("GPUFEED_REQUIRE_GPU=1 but torch sees no GPU")
        pytest.skip("no GPU: torch.cuda.is_available() is False")
    return torch


def _save(torch, path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def _checkpoint(torch, tmp_path):
    """A file of odd tensors (every common dtype, an empty one); its tensors on the CPU."""
    g = torch.Generator().manual_seed(11)
    tensors = {
        "f32": torch.randn(1001, 3, generator=g),
        "f16": torch.randn(7, 333, generator=g).half(),
        "bf16": torch.randn(1_500_001, generator=g).bfloat16(),
        "i64": torch.randint(-(2**40), 2**40, (17,), generator=g),
        "u8": torch.randint(0, 255, (1_000_003,), generator=g, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (5, 5), generator=g).bool(),
        "empty": torch.zeros(0, 4),
        "f64": torch.randn(3, 5, generator=g).double(),
    }
    path = tmp_path / "m.safetensors"
    _save(torch, path, tensors)
    return path, tensors


def _empty_like(torch, tensors, device="cuda:0"):
    return {n: torch.full_like(t, 0, device=device) for n, t in tensors.items()}


def test_cpu_tensors_and_bad_calls_are_refused(tmp_path):
    torch = _torch()
    path, tensors = _checkpoint(torch, tmp_path)
    with pytest.raises(gpufeed.SafetensorError, match="on cpu"):
        gpufeed.load_into(path, {"f32": torch.zeros(1001, 3)})
    with pytest.raises(TypeError):
        gpufeed.load_into(path)
    with pytest.raises(TypeError):
        gpufeed.load_into(path, {}, model=torch.nn.Linear(2, 2))
    with pytest.raises(gpufeed.SafetensorError, match="local files"):
        gpufeed.load_into("s3://bucket/m.safetensors", {})
    # Nothing to write into: every tensor unexpected (an error under strict).
    with pytest.raises(gpufeed.SafetensorError, match="strict"):
        gpufeed.load_into(path, {})
    got = gpufeed.load_into(path, {}, strict=False)
    assert got.missing_keys == [] and sorted(got.unexpected_keys) == sorted(tensors)
    with pytest.raises(FileNotFoundError):
        gpufeed.load_into(tmp_path / "nope.safetensors", {}, strict=False)
    # Plans are checked before anything else happens: a name without a destination, a value
    # that is no slice, bounds that are no integers.
    with pytest.raises(gpufeed.SafetensorError, match="no destination"):
        gpufeed.load_into(path, {}, strict=False, plan={"f32": slice(0, 2)})
    from gpufeed._into import _plan_slices

    with pytest.raises(gpufeed.SafetensorError, match="dict"):
        _plan_slices([slice(0, 1)], ["f32"])
    with pytest.raises(gpufeed.SafetensorError, match="None, a slice or a tuple of slices"):
        _plan_slices({"f32": (0, 1)}, ["f32"])
    with pytest.raises(gpufeed.SafetensorError, match="narrows 2 dimensions"):
        _plan_slices({"f32": (slice(0, 1), slice(0, 1))}, ["f32"])
    # A tuple narrows its one sliced dimension; slice(None) everywhere is the whole tensor.
    assert _plan_slices({"f32": (slice(None), slice(1, 3))}, ["f32"]) == [(1, (1, 3, None))]
    assert _plan_slices({"f32": (slice(None), slice(None))}, ["f32"]) == [None]
    assert _plan_slices({"f32": (slice(0, None, 1), slice(1, 3))}, ["f32"]) == [(1, (1, 3, None))]
    with pytest.raises(gpufeed.SafetensorError, match="Ellipsis"):
        _plan_slices({"f32": (Ellipsis, slice(1, 3))}, ["f32"])
    with pytest.raises(gpufeed.SafetensorError, match="integers or None"):
        _plan_slices({"f32": slice(0.5, 2)}, ["f32"])
    with pytest.raises(gpufeed.SafetensorError, match="integers or None"):
        _plan_slices({"f32": slice(True, 2)}, ["f32"])
    assert _plan_slices(None, ["f32"]) is None
    np = pytest.importorskip("numpy")
    assert _plan_slices({"f32": slice(np.int64(1), np.int32(3))}, ["f32"]) == [(0, (1, 3, None))]
    assert _plan_slices({"f32": slice(-3, None), "u8": None}, ["f32", "u8", "f16"]) == [
        (0, (-3, None, None)), None, None]


def test_tensors_land_bit_for_bit_in_preallocated_tensors(tmp_path):
    torch = _torch_on_gpu()
    path, tensors = _checkpoint(torch, tmp_path)
    for staging in (None, 1 << 20):
        dst = _empty_like(torch, tensors)
        got = gpufeed.load_into(path, dst, staging_bytes=staging)
        assert got.missing_keys == [] and got.unexpected_keys == []
        for name, t in tensors.items():
            assert dst[name].dtype == t.dtype and dst[name].shape == t.shape
            assert torch.equal(dst[name].cpu().view(torch.uint8) if t.numel() else dst[name].cpu(),
                               t.view(torch.uint8) if t.numel() else t), name

    # An index of two shards, as transformers writes it.
    g = torch.Generator().manual_seed(12)
    a = {"a.w": torch.randn(333, 77, generator=g), "a.b": torch.randn(5, generator=g)}
    b = {"b.w": torch.randn(1_000_001, generator=g).half()}
    _save(torch, tmp_path / "s-1.safetensors", a)
    _save(torch, tmp_path / "s-2.safetensors", b)
    index = tmp_path / "s.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {
        **{n: "s-1.safetensors" for n in a}, **{n: "s-2.safetensors" for n in b}}}))
    both = {**a, **b}
    dst = _empty_like(torch, both)
    gpufeed.load_into(index, dst)
    for name, t in both.items():
        assert torch.equal(dst[name].cpu(), t), name


def test_missing_unexpected_and_mismatched_destinations(tmp_path):
    torch = _torch_on_gpu()
    path, tensors = _checkpoint(torch, tmp_path)
    some = _empty_like(torch, {n: tensors[n] for n in ("f32", "u8")})
    some["not.there"] = torch.zeros(3, device="cuda:0")
    with pytest.raises(gpufeed.SafetensorError, match="not.there"):
        gpufeed.load_into(path, some)
    assert int(some["f32"].abs().sum()) == 0, "strict: nothing written"
    got = gpufeed.load_into(path, some, strict=False)
    assert got.missing_keys == ["not.there"]
    assert sorted(got.unexpected_keys) == sorted(set(tensors) - {"f32", "u8"})
    assert torch.equal(some["f32"].cpu(), tensors["f32"])

    # A dtype, a shape, an overlap: refused, nothing written.
    for bad, match in (
        ({"f32": torch.zeros(1001, 3, dtype=torch.float64, device="cuda:0")}, "F64"),
        ({"f32": torch.zeros(3, 1001, device="cuda:0")}, r"\[3, 1001\]"),
    ):
        with pytest.raises(gpufeed.SafetensorError, match=match):
            gpufeed.load_into(path, bad, strict=False)
        assert int(next(iter(bad.values())).abs().sum()) == 0
    block = torch.zeros(2, 1001 * 3, device="cuda:0")
    overlapping = {"f32": block[0].view(1001, 3), "f64": block[0, :30].view(torch.float64).view(3, 5)}
    with pytest.raises(gpufeed.SafetensorError, match="overlap"):
        gpufeed.load_into(path, overlapping, strict=False)
    assert int(block.abs().sum()) == 0
    with pytest.raises(gpufeed.SafetensorError, match="contiguous"):
        gpufeed.load_into(path, {"f32": torch.zeros(3, 1001, device="cuda:0").t()}, strict=False)


def test_a_module_with_tied_weights_loads_in_place_with_bounded_memory(tmp_path):
    torch = _torch_on_gpu()

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(8192, 1024)
            self.norm = torch.nn.LayerNorm(1024)
            self.head = torch.nn.Linear(1024, 8192, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(13)
    src = Tied()
    state = {k: v.detach().clone().contiguous() for k, v in src.state_dict().items()}
    path = tmp_path / "tied.safetensors"
    # Tied weights saved once each name (as a user's save_file of clones does).
    _save(torch, path, state)
    model = Tied().to("cuda:0")
    params_before = [p.data_ptr() for p in model.parameters()]
    staging = 4 << 20
    # A first load makes the process's loader (host staging) and the copy machinery.
    gpufeed.load_into(path, model=model, staging_bytes=staging)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(0)
    lowest = [free_before]
    done = threading.Event()

    def watch():
        # The load gives up the GIL while it runs: sampled every millisecond, its peak.
        while not done.wait(0.001):
            lowest[0] = min(lowest[0], torch.cuda.mem_get_info(0)[0])

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        gpufeed.load_into(path, model=model, staging_bytes=staging)
        torch.cuda.synchronize()
    finally:
        done.set()
        watcher.join()
    assert [p.data_ptr() for p in model.parameters()] == params_before, "written in place"
    for name, t in state.items():
        assert torch.equal(model.state_dict()[name].cpu(), t), name
    # Beyond the destinations, at the peak: the two staging buffers and what the driver takes
    # with them (10 MiB with 512 MiB buffers in GPU run 146): less than another copy of the
    # 32 MiB model, or of its largest tensor, would take.
    assert free_before - lowest[0] <= 2 * staging + (16 << 20), (free_before, lowest[0])


def test_row_plans_write_each_ranks_rows_bit_for_bit(tmp_path):
    """Each of 3 ranks' row shares (uneven, one of them empty at the edge) of 2-d, 1-d and
    3-d tensors lands bit for bit against safetensors' ``get_slice(name)[a:b]``, with a
    staging small enough to split them; negative and open bounds as Python's; bad plans are
    refused with nothing written."""
    torch = _torch_on_gpu()
    from safetensors import safe_open

    g = torch.Generator().manual_seed(13)
    tensors = {"w": torch.randn(1001, 37, generator=g), "v": torch.randn(999_983, generator=g).half(),
               "c": torch.randn(10, 4, 3, generator=g).bfloat16(), "s": torch.tensor(2.5)}
    path = tmp_path / "rows.safetensors"
    _save(torch, path, tensors)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for ranks in (1, 3):
            for r in range(ranks):
                plan, dst, want = {}, {}, {}
                for name in ("w", "v", "c"):
                    n = tensors[name].shape[0]
                    a, b = r * n // ranks, (r + 1) * n // ranks
                    plan[name] = slice(a, b)
                    want[name] = f.get_slice(name)[a:b]
                    dst[name] = torch.zeros((b - a, *tensors[name].shape[1:]),
                                            dtype=tensors[name].dtype, device="cuda:0")
                got = gpufeed.load_into(path, dst, strict=False, plan=plan, staging_bytes=1 << 20)
                assert got.missing_keys == [] and sorted(got.unexpected_keys) == ["s"]
                for name in want:
                    assert torch.equal(dst[name].cpu().view(torch.uint8),
                                       want[name].contiguous().view(torch.uint8)), (ranks, r, name)
        # Python's bounds: negative, open, past-the-start stop (empty).
        for sl in (slice(-5, None), slice(None, 3), slice(7, 2), slice(None, None)):
            want = f.get_slice("w")[sl]
            dst = torch.zeros(want.shape, dtype=torch.float32, device="cuda:0")
            gpufeed.load_into(path, {"w": dst}, strict=False, plan={"w": sl})
            assert torch.equal(dst.cpu(), want), sl
    # Refused, nothing written: out of range, step 2, a 0-d tensor, a destination of the
    # whole tensor's shape under a plan of fewer rows.
    dst = torch.full((10, 37), 7.0, device="cuda:0")
    for plan, text in (({"w": slice(0, 1002)}, "out of range"), ({"w": slice(0, 10, 2)}, "step 1"),
                       ({"s": slice(0, 1)}, "0-d")):
        target = {"w": dst} if "w" in plan else {"s": torch.zeros((), device="cuda:0")}
        with pytest.raises(gpufeed.SafetensorError, match=text):
            gpufeed.load_into(path, target, strict=False, plan=plan)
    with pytest.raises(gpufeed.SafetensorError, match="planned part"):
        gpufeed.load_into(path, {"w": dst}, strict=False, plan={"w": slice(0, 11)})
    assert bool((dst == 7.0).all()), "a refused plan wrote into its destination"



def test_column_plans_write_each_ranks_columns_bit_for_bit(tmp_path):
    """Each of 1, 2 and 3 ranks' shares of a split along dimension 1 (and 2 of a 3-d tensor)
    lands bit for bit against safetensors' ``get_slice``, with stagings that split the span
    mid-run (1 MiB) or not (the default); a part that is contiguous in the tensor (every
    column of one rank, the columns of a one-row matrix) is a plain one; a cast of a column part is refused, as are bounds out of
    range and a dimension the tensor lacks, with nothing written."""
    torch = _torch_on_gpu()
    from safetensors import safe_open

    g = torch.Generator().manual_seed(17)
    tensors = {"w": torch.randn(1001, 1037, generator=g), "h": torch.randn(4099, 333, generator=g).half(),
               "c": torch.randn(10, 4, 37, generator=g).bfloat16(), "r": torch.randn(1, 999, generator=g)}
    path = tmp_path / "columns.safetensors"
    _save(torch, path, tensors)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for staging in (1 << 20, None):
            for ranks in (1, 2, 3):
                for r in range(ranks):
                    plan, dst, want, whole = {}, {}, {}, {}
                    for name, dim in (("w", 1), ("h", 1), ("c", 2), ("r", 1)):
                        n = tensors[name].shape[dim]
                        a, b = r * n // ranks, (r + 1) * n // ranks
                        index = (slice(None),) * dim + (slice(a, b),)
                        plan[name] = index
                        want[name] = f.get_slice(name)[index]
                        # A view of a larger buffer: nothing may be written past the part.
                        n = want[name].numel()
                        whole[name] = torch.full((n + 4099,), 7, dtype=tensors[name].dtype,
                                                 device="cuda:0")
                        dst[name] = whole[name][:n].view(want[name].shape)
                    got = gpufeed.load_into(path, dst, strict=False, plan=plan,
                                            staging_bytes=staging)
                    assert got.missing_keys == []
                    for name in want:
                        assert torch.equal(dst[name].cpu().view(torch.uint8),
                                           want[name].contiguous().view(torch.uint8)), (
                            staging, ranks, r, name)
                        tail = whole[name][want[name].numel():]
                        assert bool((tail == 7).all()), (staging, ranks, r, name, "past the part")
        # Dimension 1 of the 3-d tensor, negative bounds.
        want = f.get_slice("c")[:, -3:]
        dst = torch.zeros(want.shape, dtype=torch.bfloat16, device="cuda:0")
        gpufeed.load_into(path, {"c": dst}, strict=False, plan={"c": (slice(None), slice(-3, None))})
        assert torch.equal(dst.cpu().view(torch.uint8), want.contiguous().view(torch.uint8))
    dst = torch.full((1001, 10), 7.0, device="cuda:0")
    for plan, target, text in (
        ({"w": (slice(None), slice(0, 10))}, {"w": torch.full((1001, 5), 7.0, device="cuda:0")},
         "planned part"),
        ({"w": (slice(None), slice(0, 1038))}, {"w": dst}, "out of range"),
        ({"w": (slice(None), slice(None), slice(0, 1))}, {"w": dst}, "no dimension 2"),
    ):
        with pytest.raises(gpufeed.SafetensorError, match=text):
            gpufeed.load_into(path, target, strict=False, plan=plan)
    assert bool((dst == 7.0).all()), "a refused plan wrote into its destination"
