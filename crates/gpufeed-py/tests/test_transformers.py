"""``gpufeed.transformers.from_pretrained`` on the CPU (``device="cpu"``): a small
Llama-architecture model saved by ``save_pretrained`` (one file, and sharded), tied and
untied, in the checkpoint's dtype and cast, has bit-identical parameters, buffers, logits and
greedy generations to transformers' own ``from_pretrained``; missing or misshapen tensors and a
missing model are refused with what is wrong; ``import gpufeed`` does not import transformers.

Skipped (with the reason) where torch or transformers is not installed (CI installs both). The
GPU form is in test_transformers_gpu.py."""

import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest


def requirements():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torch or transformers is not installed ({e})")
    return torch


def save(torch, directory, tie, shard="100KB"):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1013, hidden_size=96, intermediate_size=261,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=tie)
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    saved = os.path.join(directory, f"model-{tie}-{shard}")
    model.save_pretrained(saved, max_shard_size=shard)
    return saved


def raw(torch, t):
    return t.view(torch.uint8) if t.dtype != torch.bool else t


def assert_same_model(torch, want, got, what):
    a, b = want.state_dict(), got.state_dict()
    assert sorted(a) == sorted(b), f"{what}: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, f"{what}: {k}"
        assert torch.equal(raw(torch, a[k]), raw(torch, b[k])), f"{what}: {k} differs"
    bufs = dict(got.named_buffers())
    for k, v in want.named_buffers():
        assert v.dtype == bufs[k].dtype and torch.equal(v, bufs[k]), f"{what}: buffer {k}"
    ids = torch.arange(24).reshape(1, 24) % want.config.vocab_size
    with torch.no_grad():
        assert torch.equal(want(ids).logits, got(ids).logits), f"{what}: logits differ"
    assert (want.generate(ids, max_new_tokens=4, do_sample=False).tolist()
            == got.generate(ids, max_new_tokens=4, do_sample=False).tolist()), what


def test_bit_identical_to_transformers_on_the_cpu():
    torch = requirements()
    import gpufeed.transformers
    from transformers import AutoModelForCausalLM

    # The reference reads through safetensors itself, not through gpufeed's patch (which
    # GPUFEED_PATCH_SAFETENSORS=1 makes at start-up).
    if gpufeed.is_patched():
        gpufeed.unpatch_safetensors()
    assert not gpufeed.is_patched()

    with tempfile.TemporaryDirectory() as d:
        for tie in (False, True):
            for shard in ("100KB", "1GB"):
                saved = save(torch, d, tie, shard)
                files = [n for n in os.listdir(saved) if n.endswith(".safetensors")]
                assert (len(files) > 1) == (shard == "100KB"), files
                for dtype in (torch.bfloat16, torch.float32, "float16", None):
                    what = f"tie={tie}, {len(files)} files, dtype={dtype}"
                    ours = gpufeed.transformers.from_pretrained(saved, device="cpu",
                                                                dtype=dtype)
                    # None: the config's dtype (what save_pretrained wrote), as transformers'
                    # "auto".
                    theirs = AutoModelForCausalLM.from_pretrained(
                        saved, dtype=dtype if dtype is not None else "auto")
                    assert not ours.training, what
                    if tie:
                        assert ours.lm_head.weight is ours.model.embed_tokens.weight, what
                    assert_same_model(torch, theirs, ours, what)


def test_refusals_name_what_is_wrong():
    torch = requirements()
    import gpufeed.transformers
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as d:
        with pytest.raises(FileNotFoundError, match="no such directory"):
            gpufeed.transformers.from_pretrained(os.path.join(d, "nope"), device="cpu")
        empty = os.path.join(d, "empty")
        os.mkdir(empty)
        with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
            gpufeed.transformers.from_pretrained(empty, device="cpu")
        saved = save(torch, d, tie=False, shard="1GB")
        single = os.path.join(saved, "model.safetensors")
        state = load_file(single)
        with pytest.raises(ValueError, match="dtype"):
            gpufeed.transformers.from_pretrained(saved, device="cpu", dtype="float99")
        # A tensor missing: refused, naming it.
        save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, single,
                  metadata={"format": "pt"})
        with pytest.raises(ValueError, match="model.norm.weight"):
            gpufeed.transformers.from_pretrained(saved, device="cpu")
        # A tensor of another shape: refused, naming it and both shapes.
        bad = dict(state)
        bad["model.norm.weight"] = torch.ones(95, dtype=torch.bfloat16)
        save_file(bad, single, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=r"model.norm.weight has shape \(95,\)"):
            gpufeed.transformers.from_pretrained(saved, device="cpu")
        # A tensor the model does not have: left out with a warning, the rest loads.
        extra = dict(state)
        extra["model.extra.weight"] = torch.zeros(3, dtype=torch.bfloat16)
        save_file(extra, single, metadata={"format": "pt"})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = gpufeed.transformers.from_pretrained(saved, device="cpu")
        assert any("model.extra.weight" in str(w.message) for w in caught), caught
        assert torch.equal(raw(torch, model.model.norm.weight),
                           raw(torch, state["model.norm.weight"]))
        # A shard named by the index but absent: the file is named.
        sharded = save(torch, d, tie=False, shard="100KB")
        with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
            victim = sorted(set(json.load(f)["weight_map"].values()))[-1]
        os.remove(os.path.join(sharded, victim))
        with pytest.raises(Exception, match=victim):
            gpufeed.transformers.from_pretrained(sharded, device="cpu")


def test_import_gpufeed_does_not_import_transformers():
    run = subprocess.run([sys.executable, "-c",
                          "import sys, gpufeed, gpufeed.torch; print('transformers' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False", run.stdout
