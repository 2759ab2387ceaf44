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


# A Megatron-style plan: attention and MLP inputs split by rows (output features), their
# outputs by columns (input features), the head by rows (vocabulary).
TP_PLAN = {
    "model.layers.*.self_attn.[qkv]_proj.weight": "rows",
    "model.layers.*.self_attn.o_proj.weight": "columns",
    "model.layers.*.mlp.gate_proj.weight": "rows",
    "model.layers.*.mlp.up_proj.weight": "rows",
    "model.layers.*.mlp.down_proj.weight": "columns",
    "lm_head.weight": "rows",
}


def assert_shares(torch, full, share, rank, world, what):
    """Each planned parameter of ``share`` is its rank's rows or columns of ``full``'s, bit
    for bit; the others equal ``full``'s."""
    import fnmatch

    a, b = full.state_dict(), share.state_dict()
    assert sorted(a) == sorted(b), what
    split = 0
    for name, t in a.items():
        how = next((v for p, v in TP_PLAN.items() if fnmatch.fnmatchcase(name, p)), None)
        if how is not None:
            dim = {"rows": 0, "columns": 1}[how]
            n = t.shape[dim]
            t = t.narrow(dim, rank * n // world, (rank + 1) * n // world - rank * n // world)
            split += 1
        assert b[name].dtype == t.dtype and b[name].shape == t.shape, f"{what}: {name}"
        assert torch.equal(raw(torch, b[name]), raw(torch, t.contiguous())), f"{what}: {name}"
    assert split == 2 * 7 + 1, f"{what}: {split} tensors split"


def test_a_tensor_parallel_rank_gets_its_rows_and_columns(monkeypatch):
    """``tp_plan``: each rank of 1, 2 and 3 (uneven shares) gets its rows and columns of the
    planned parameters and the rest whole, as slices of the full model, cast as the full
    model is; rank and world from torchrun's variables; tied weights planned alike (a
    vocabulary-parallel embedding and head) load, planned unalike are refused; bad plans,
    ranks and checkpoints refused."""
    torch = requirements()
    import gpufeed.transformers
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as d:
        saved = save(torch, d, tie=False, shard="100KB")
        for dtype in (torch.bfloat16, torch.float32):
            full = gpufeed.transformers.from_pretrained(saved, device="cpu", dtype=dtype)
            for world in (1, 2, 3):
                for rank in range(world):
                    share = gpufeed.transformers.from_pretrained(
                        saved, device="cpu", dtype=dtype, tp_plan=TP_PLAN, rank=rank,
                        world_size=world)
                    assert not share.training
                    assert_shares(torch, full, share, rank, world, f"{dtype} {rank}/{world}")
                    assert isinstance(share.lm_head.weight, torch.nn.Parameter)
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        share = gpufeed.transformers.from_pretrained(saved, device="cpu", tp_plan=TP_PLAN)
        full = gpufeed.transformers.from_pretrained(saved, device="cpu")
        assert_shares(torch, full, share, 1, 2, "from RANK / WORLD_SIZE")
        for kwargs, text in (
            (dict(tp_plan={"lm_head.weight": "diagonal"}, rank=0, world_size=2), "'rows' or"),
            (dict(tp_plan={"model.norm.weight": "columns"}, rank=0, world_size=2), "shape"),
            (dict(tp_plan={"model.layer.*.mlp.up_proj.weight": "rows"}, rank=0, world_size=2),
             "match no parameter"),
            (dict(tp_plan=TP_PLAN, rank=2, world_size=2), "0 <= rank"),
            (dict(tp_plan=TP_PLAN, rank=1.5, world_size=2), "integers"),
            (dict(rank=0, world_size=2), "go with tp_plan"),
        ):
            with pytest.raises(ValueError, match=text):
                gpufeed.transformers.from_pretrained(saved, device="cpu", **kwargs)
        monkeypatch.delenv("RANK")
        with pytest.raises(ValueError, match="torchrun"):
            gpufeed.transformers.from_pretrained(saved, device="cpu", tp_plan=TP_PLAN)

        # Tied: the checkpoint has no lm_head.weight; planned alike with the embedding, the
        # head is the embedding's share; planned alone, refused naming the tie.
        tied = save(torch, d, tie=True, shard="1GB")
        full = gpufeed.transformers.from_pretrained(tied, device="cpu")
        vocab = {"model.embed_tokens.weight": "rows", "lm_head.weight": "rows"}
        for rank in range(2):
            share = gpufeed.transformers.from_pretrained(tied, device="cpu", tp_plan=vocab,
                                                         rank=rank, world_size=2)
            want = full.model.embed_tokens.weight[rank * 1013 // 2:(rank + 1) * 1013 // 2]
            assert torch.equal(raw(torch, share.model.embed_tokens.weight), raw(torch, want))
            assert share.lm_head.weight is share.model.embed_tokens.weight
        with pytest.raises(ValueError, match="tied"):
            gpufeed.transformers.from_pretrained(tied, device="cpu", rank=0, world_size=2,
                                                 tp_plan={"lm_head.weight": "rows"})
        # A planned tensor of another shape in the checkpoint: refused, not sliced.
        single = os.path.join(tied, "model.safetensors")
        state = load_file(single)
        state["model.embed_tokens.weight"] = torch.zeros(1020, 96, dtype=torch.bfloat16)
        save_file(state, single, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(1020, 96\)"):
            gpufeed.transformers.from_pretrained(tied, device="cpu", tp_plan=vocab, rank=0,
                                                 world_size=2)


def test_the_gpu_paths_plans_are_the_cpu_paths_shares(monkeypatch):
    """The GPU branch of the tensor-parallel load, with ``load_into`` stood in for by a CPU
    function that writes each destination from the checkpoint as its plan says (the GPU
    machine runs the real one: test_transformers_gpu.py): the destinations it makes (dtype,
    shape) and the plans it gives are those of the CPU branch's shares, cast as the model's
    parameters are, and checkpoint tensors the model lacks are named, not read."""
    torch = requirements()
    import gpufeed
    import gpufeed.transformers as gt
    from transformers import AutoConfig, AutoModelForCausalLM

    asked = {}

    def stand_in(path, dests, *, strict=True, plan=None, **_):
        assert strict is False
        asked.update(plan or {})
        with gpufeed.safe_open(path, framework="pt", device="cpu") as f:
            for name, dst in dests.items():
                t = f.get_tensor(name)
                part = (plan or {}).get(name)
                dst.copy_((t[part] if part is not None else t).to(dst.dtype))

    monkeypatch.setattr(gpufeed, "load_into", stand_in)
    with tempfile.TemporaryDirectory() as d:
        saved = save(torch, d, tie=False, shard="100KB")
        checkpoint = os.path.join(saved, "model.safetensors.index.json")
        config = AutoConfig.from_pretrained(saved)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        params = dict(model.named_parameters(remove_duplicate=False))
        parts = gt._tp_parts(TP_PLAN, params, 1, 3)
        from gpufeed.torch import load_file

        cpu, cpu_extra = gt._load_shares(torch, checkpoint, model, parts, None, None, load_file)
        gpu, gpu_extra = gt._load_shares(torch, checkpoint, model, parts, 0,
                                         torch.device("cpu"), load_file)
        assert cpu_extra == [] and gpu_extra == []
        assert sorted(gpu) == sorted(cpu)
        for name, t in gpu.items():
            # The GPU branch casts on the way into the parameter's dtype (F32 here).
            assert t.dtype == torch.float32 and t.shape == cpu[name].shape, name
            assert torch.equal(t, cpu[name].to(torch.float32)), name
        for name, (dim, start, stop) in parts.items():
            want = slice(start, stop) if dim == 0 else (slice(None), slice(start, stop))
            assert asked[name] == want, name


def test_import_gpufeed_does_not_import_transformers():
    run = subprocess.run([sys.executable, "-c",
                          "import sys, gpufeed, gpufeed.torch; print('transformers' in sys.modules)"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False", run.stdout
