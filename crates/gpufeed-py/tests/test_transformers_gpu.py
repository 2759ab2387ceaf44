"""transformers' ``from_pretrained`` with ``gpufeed.patch_safetensors()``, and
``gpufeed.transformers.from_pretrained``: a small Llama-architecture model saved sharded by
``save_pretrained`` loads with bit-identical parameters and logits, on the GPU, whether
safetensors or gpufeed reads the shards (and the patch really routed the reads); tied and
untied, in the checkpoint's dtype and cast to another.

Skipped (with the reason) without torch, transformers or a GPU, unless
``GPUFEED_REQUIRE_GPU=1`` (the GPU machine), where that is a failure."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

REQUIRED = os.environ.get("GPUFEED_REQUIRE_GPU") == "1"

SCRIPT = r"""
import json, os, sys, torch
if os.environ.get("ROUTE") == "gpufeed":
    import gpufeed
    gpufeed.patch_safetensors()
    import gpufeed._safe_open as so
    opened = []
    real_init = so.safe_open.__init__
    def counting(self, *a, **k):
        opened.append(a[0] if a else k.get("filename"))
        real_init(self, *a, **k)
    so.safe_open.__init__ = counting
dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
from transformers import LlamaForCausalLM
class Kept(LlamaForCausalLM):
    # A model whose own code keeps one parameter in float32 whatever the dtype.
    def __init__(self, config):
        super().__init__(config)
        self.kept = torch.nn.Parameter(torch.zeros(257, dtype=torch.float32))
class Odd(LlamaForCausalLM):
    # A model with a tensor of an odd number of elements whose bytes come first in the file:
    # the tensors after it sit 2 bytes off any alignment there.
    def __init__(self, config):
        super().__init__(config)
        self.a_odd = torch.nn.Parameter(torch.zeros(257))
cls = {"kept": Kept, "odd": Odd}.get(os.environ.get("MODEL", ""))
if os.environ.get("ROUTE") == "gpufeed.transformers":
    import gpufeed.transformers
    model = gpufeed.transformers.from_pretrained(sys.argv[1], device="cuda:0", dtype=dtype,
                                                 model_class=cls)
    assert not model.training
    assert all(p.device == torch.device("cuda:0") for p in model.parameters())
    assert all(b.device == torch.device("cuda:0") for b in model.buffers())
    # cuBLAS picks kernels by its operands' alignment (torch reports up to 256 bytes).
    odd = [n for n, p in model.named_parameters() if p.numel() and p.data_ptr() % 256]
    assert not odd, f"parameters not 256-byte aligned: {odd[:5]}"
else:
    from transformers import AutoModelForCausalLM
    model = (cls or AutoModelForCausalLM).from_pretrained(sys.argv[1], dtype=dtype,
                                                          device_map="cuda:0")
ids = torch.arange(32, device="cuda:0").reshape(1, 32) % model.config.vocab_size
with torch.no_grad():
    logits = model(ids).logits.float().cpu()
state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
torch.save({"state": state, "logits": logits}, sys.argv[2])
if os.environ.get("ROUTE") == "gpufeed":
    print(json.dumps({"opened": len(opened)}))
"""


def requirements():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        reason = f"torch or transformers is not installed ({e})"
    else:
        if torch.cuda.is_available():
            return torch
        reason = "torch sees no CUDA device"
    if REQUIRED:
        raise AssertionError(f"GPUFEED_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


def _save(torch, directory, tie):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1013, hidden_size=192, intermediate_size=517,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    saved = os.path.join(directory, f"model-{tie}")
    model.save_pretrained(saved, max_shard_size="1MB")
    shards = [n for n in os.listdir(saved) if n.endswith(".safetensors")]
    assert len(shards) > 1, f"a sharded save: {shards}"
    return saved, shards


def _run(torch, directory, saved, route, dtype="bfloat16", model=""):
    """The state and logits of the model loaded by ``route`` in a fresh process (``model``:
    "kept", the model class with a parameter kept in float32; "odd", with a 257-element
    parameter first in the file), and what it printed."""
    out = os.path.join(directory, f"{route}-{dtype}.pt")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPUFEED_PATCH_SAFETENSORS", "DTYPE", "MODEL")}
    run = subprocess.run([sys.executable, "-c", SCRIPT, saved, out],
                         env={**env, "ROUTE": route, "DTYPE": dtype, "MODEL": model},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{route}: {run.stderr[-3000:]}"
    return torch.load(out), run.stdout


def _assert_same(torch, a, b, what):
    assert sorted(a["state"]) == sorted(b["state"]), what
    for k in a["state"]:
        x, y = a["state"][k], b["state"][k]
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {k}"
        assert torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                           y.view(torch.uint8) if y.dtype != torch.bool else y), f"{what}: {k}"
    assert torch.equal(a["logits"], b["logits"]), f"{what}: logits differ"


def test_from_pretrained_through_gpufeed_is_bit_identical():
    torch = requirements()
    with tempfile.TemporaryDirectory() as d:
        saved, shards = _save(torch, d, tie=False)
        own, _ = _run(torch, d, saved, "safetensors")
        routed, printed = _run(torch, d, saved, "gpufeed")
        opened = int(printed.strip().splitlines()[-1].split(":")[1].strip(" }"))
        assert opened >= len(shards), f"gpufeed opened {opened} of {len(shards)} shards"
        _assert_same(torch, own, routed, "patched safetensors")


def test_gpufeed_transformers_from_pretrained_is_bit_identical():
    """``gpufeed.transformers.from_pretrained`` against transformers' own, tied and untied, in
    the checkpoint's dtype and cast to float16 and float32 on the way."""
    torch = requirements()
    with tempfile.TemporaryDirectory() as d:
        for tie in (False, True):
            saved, _ = _save(torch, d, tie)
            for dtype in ("bfloat16", "float16", "float32"):
                own, _ = _run(torch, d, saved, "safetensors", dtype)
                ours, _ = _run(torch, d, saved, "gpufeed.transformers", dtype)
                _assert_same(torch, own, ours, f"tie={tie}, {dtype}")


def test_tensors_after_an_odd_sized_one_compute_as_transformers_own():
    """A bfloat16 checkpoint (no cast) whose first tensor has 257 elements: the tensors after
    it sit at 2-byte offsets in the file, and the model's parameters must still be aligned as
    transformers' own allocations are (cuBLAS chooses kernels by alignment: run 160 saw the
    logits differ for such views with every parameter equal)."""
    torch = requirements()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as d:
        config = LlamaConfig(vocab_size=1013, hidden_size=192, intermediate_size=512,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False)
        torch.manual_seed(2)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.register_parameter("a_odd", torch.nn.Parameter(
            torch.randn(257).to(torch.bfloat16)))
        saved = os.path.join(d, "odd")
        model.save_pretrained(saved)
        with open(os.path.join(saved, "model.safetensors"), "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        assert header["a_odd"]["data_offsets"] == [0, 514], header["a_odd"]
        own, _ = _run(torch, d, saved, "safetensors", "bfloat16", model="odd")
        ours, _ = _run(torch, d, saved, "gpufeed.transformers", "bfloat16", model="odd")
        _assert_same(torch, own, ours, "after an odd-sized tensor")


def test_a_parameter_the_model_keeps_in_float32_loads_as_transformers_loads_it():
    """A float32 checkpoint of a model whose code keeps one parameter in float32, loaded in
    bfloat16: the other tensors cast on the way, that one as transformers' own makes it."""
    torch = requirements()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as d:
        config = LlamaConfig(vocab_size=1013, hidden_size=192, intermediate_size=517,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=False)
        torch.manual_seed(1)
        model = LlamaForCausalLM(config)
        # The parameter's values with low bits that bfloat16 drops.
        model.register_parameter("kept", torch.nn.Parameter(torch.randn(257) / 3))
        saved = os.path.join(d, "kept")
        model.save_pretrained(saved, max_shard_size="1MB")
        own, _ = _run(torch, d, saved, "safetensors", "bfloat16", model="kept")
        ours, _ = _run(torch, d, saved, "gpufeed.transformers", "bfloat16", model="kept")
        assert own["state"]["kept"].dtype == torch.float32
        print("transformers keeps the float32 bits:",
              torch.equal(own["state"]["kept"], model.kept.detach()))
        _assert_same(torch, own, ours, "kept in float32")


def test_a_tensor_parallel_rank_gets_its_rows_and_columns_on_the_gpu():
    """``tp_plan`` on the GPU (``load_into`` with row and column plans, cast on the way into
    float32 parameters): each rank of 2 and 3 gets its shares of the full model's parameters
    bit for bit (the full model is transformers' own, bit for bit: the tests above)."""
    torch = requirements()
    import gpufeed.transformers
    from test_transformers import TP_PLAN, assert_shares, save

    with tempfile.TemporaryDirectory() as d:
        saved = save(torch, d, tie=False, shard="100KB")
        for dtype in (torch.bfloat16, torch.float32):
            full = gpufeed.transformers.from_pretrained(saved, device="cuda:0", dtype=dtype)
            for world in (2, 3):
                for rank in range(world):
                    share = gpufeed.transformers.from_pretrained(
                        saved, device="cuda:0", dtype=dtype, tp_plan=TP_PLAN, rank=rank,
                        world_size=world)
                    assert all(p.device == torch.device("cuda:0") for p in share.parameters())
                    assert_shares(torch, full, share, rank, world, f"{dtype} {rank}/{world}")
