#!/usr/bin/env python3
"""Table 10's model rows: a Llama-architecture model saved by transformers' ``save_pretrained``
in shards (issue 39's: hidden 4096, 16 layers, 6.2 GB in bfloat16, 4 shards), made ready on
cuda:0 in fresh processes that created torch's CUDA context before the clock (warm page cache):

- transformers' ``AutoModelForCausalLM.from_pretrained(dir, dtype=bfloat16, device_map="cuda:0")``;
- ``gpufeed.transformers.from_pretrained(dir, device="cuda:0", dtype=bfloat16)``;
- ``gpufeed.load_safetensors`` of the shards (their index), and of one file holding the same tensors
  (how much the shards cost against one file).

The imports (torch, transformers, gpufeed) are made before the clock: what is timed is the
model made ready from files in the page cache; in the rows "model code imported" the model's
own module too (transformers imports it on the first use of the class). ``MODELS_METHODS`` (a
comma-separated list of the methods) measures only those.

The two model rows report a digest of the logits of a fixed input (their bytes) and of each
parameter's sum of bytes: equal digests mean the same logits, bit for bit, and parameters that
agree on every checksum (the tests compare parameters byte for byte).

Usage: models.py REPS DIR [LAYERS]  -> one JSON object on stdout:
       {"bytes": n, "shards": n, "rows": {method: {"seconds": [..], "gbps": [..],
       "digest": [..]} or {"error": "..."}}}
       (DIR: where the model is made once, LAYERS: 16 unless given.)
       models.py --one METHOD DIR   -> (internal) one fresh process: JSON of its time.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

METHODS = [
    "transformers from_pretrained",
    "gpufeed.transformers.from_pretrained",
    "transformers from_pretrained (model code imported)",
    "gpufeed.transformers.from_pretrained (model code imported)",
    "gpufeed load_safetensors of the shards",
    "gpufeed load_safetensors of one file",
]
# The rows "model code imported" import the model's module (transformers imports it lazily,
# on the first use of the class: 0.3-0.9 s of the first rows) before the clock too.
CODE_IMPORTED = " (model code imported)"
ONE_FILE = "one-file.safetensors"


def make(directory, layers):
    """The model (random weights, bfloat16) saved in shards under ``directory``, and its
    tensors in one file beside them; nothing where they are there already."""
    if os.path.isfile(os.path.join(directory, ONE_FILE)):
        return
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    torch.manual_seed(11)
    with torch.device("cuda:0"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="2GB")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(directory, ONE_FILE) + ".tmp", metadata={"format": "pt"})
    os.replace(os.path.join(directory, ONE_FILE) + ".tmp", os.path.join(directory, ONE_FILE))
    del model, state
    torch.cuda.empty_cache()  # the rows' processes get the device without this one's cache


def _digest(torch, model):
    ids = torch.arange(64, device="cuda:0").reshape(1, 64) % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    h = hashlib.sha256(logits.float().cpu().numpy().tobytes())
    for name, p in sorted(model.state_dict().items()):
        b = p.detach().contiguous().view(-1).view(torch.uint8)
        h.update(name.encode())
        h.update(str(int(b.sum(dtype=torch.int64))).encode())
    return h.hexdigest()[:16]


def one(method, directory):
    """A fresh process: its imports and torch's context, then ``method`` timed."""
    import torch

    if method.startswith("gpufeed"):
        import gpufeed
        import gpufeed.transformers
    if "from_pretrained" in method:
        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()  # no progress bar on the clock
        if method.endswith(CODE_IMPORTED):
            import transformers.models.llama.modeling_llama  # noqa: F401
        method = method.removesuffix(CODE_IMPORTED)
    torch.zeros(1, device="cuda:0")
    torch.cuda.synchronize()
    t = time.perf_counter()
    model = digest = loaded = None
    if method == "transformers from_pretrained":
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16,
                                                     device_map="cuda:0")
    elif method == "gpufeed.transformers.from_pretrained":
        model = gpufeed.transformers.from_pretrained(directory, device="cuda:0",
                                                     dtype=torch.bfloat16)
    else:
        path = os.path.join(directory, "model.safetensors.index.json"
                            if method.endswith("shards") else ONE_FILE)
        loaded = gpufeed.load_safetensors(path, device=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    if model is not None:
        digest = _digest(torch, model)
    del loaded  # held to the clock's end
    print(json.dumps({"seconds": seconds, "digest": digest}))


def measure(reps, directory, layers):
    make(directory, layers)
    index = os.path.join(directory, "model.safetensors.index.json")
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    nbytes = sum(os.path.getsize(os.path.join(directory, s)) for s in shards)
    for name in shards + [ONE_FILE]:
        with open(os.path.join(directory, name), "rb") as f:
            while f.read(64 << 20):
                pass
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_PATCH_SAFETENSORS"}
    rows = {}
    chosen = [m for m in os.environ.get("MODELS_METHODS", "").split(",") if m]
    unknown = [m for m in chosen if m not in METHODS]
    if unknown:
        sys.exit(f"models.py: unknown methods {unknown}; the methods are {METHODS}")
    for method in chosen or METHODS:
        seconds, digests = [], set()
        try:
            for _ in range(reps):
                run = subprocess.run([sys.executable, __file__, "--one", method, directory],
                                     capture_output=True, text=True, timeout=600, env=env)
                if run.returncode != 0:
                    tail = run.stderr.strip().splitlines()
                    raise RuntimeError(tail[-1] if tail else f"exit {run.returncode}")
                r = json.loads(run.stdout.strip().splitlines()[-1])
                seconds.append(r["seconds"])
                if r["digest"]:
                    digests.add(r["digest"])
            rows[method] = {"seconds": seconds, "gbps": [nbytes / s / 1e9 for s in seconds],
                            "digest": sorted(digests)}
        except Exception as e:  # noqa: BLE001 (a row's failure is reported, not fatal)
            rows[method] = {"error": f"{type(e).__name__}: {e}"}
        print(f"models: {method}: {rows[method]}", file=sys.stderr)
    return {"bytes": nbytes, "shards": len(shards), "rows": rows}


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 3:
        layers = int(sys.argv[3]) if len(sys.argv) > 3 else 16
        print(json.dumps(measure(int(sys.argv[1]), sys.argv[2], layers)))
    else:
        sys.exit(__doc__)
