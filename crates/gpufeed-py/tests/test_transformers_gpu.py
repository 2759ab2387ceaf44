"""transformers' ``from_pretrained`` with ``gpufeed.patch_safetensors()``: a small
Llama-architecture model saved sharded by ``save_pretrained`` loads with bit-identical
parameters and logits, on the GPU, whether safetensors or gpufeed reads the shards (and the
patch really routed the reads).

Skipped (with the reason) without torch, transformers or a GPU, unless
``GPUFEED_REQUIRE_GPU=1`` (the GPU machine), where that is a failure."""

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
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda:0")
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


def test_from_pretrained_through_gpufeed_is_bit_identical():
    torch = requirements()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as d:
        config = LlamaConfig(vocab_size=1013, hidden_size=192, intermediate_size=517,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        saved = os.path.join(d, "model")
        model.save_pretrained(saved, max_shard_size="1MB")
        shards = [n for n in os.listdir(saved) if n.endswith(".safetensors")]
        assert len(shards) > 1, f"a sharded save: {shards}"
        outs = {}
        env = {k: v for k, v in os.environ.items() if k != "GPUFEED_PATCH_SAFETENSORS"}
        for route in ("safetensors", "gpufeed"):
            out = os.path.join(d, f"{route}.pt")
            run = subprocess.run([sys.executable, "-c", SCRIPT, saved, out],
                                 env={**env, "ROUTE": route}, capture_output=True, text=True,
                                 timeout=600)
            assert run.returncode == 0, run.stderr[-3000:]
            if route == "gpufeed":
                opened = int(run.stdout.strip().splitlines()[-1].split(":")[1].strip(" }"))
                assert opened >= len(shards), f"gpufeed opened {opened} of {len(shards)} shards"
            outs[route] = torch.load(out)
        a, b = outs["safetensors"], outs["gpufeed"]
        assert sorted(a["state"]) == sorted(b["state"])
        for k in a["state"]:
            x, y = a["state"][k], b["state"][k]
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                               y.view(torch.uint8) if y.dtype != torch.bool else y), k
        assert torch.equal(a["logits"], b["logits"]), "logits differ"
