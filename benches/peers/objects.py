#!/usr/bin/env python3
"""Table 14's peers, and gpufeed's Python package beside them: the same object and checkpoint on the same S3 server, read by the Python
clients people use, in fresh processes: the first read with the imports and the client's
set-up inside the clock (as a job that starts and loads once pays them), then a second read in
the same process with the client reused.

Usage: objects.py REPS OBJECT_KEY CHECKPOINT_KEY  -> one JSON object on stdout:
       {"rows": {name: {"fresh": [GB/s], "again": [GB/s], "bytes": n, "reads": kind}
                 or {"error": "..."}}}
       objects.py --one NAME KEY  -> (internal) one process: {"bytes": n, "seconds": [first,
       second]}

Rows of tensors on the GPU create torch's CUDA context before the clock.
The server, bucket and credentials come from the environment the bench sets
(AWS_ENDPOINT_URL, GPUFEED_BENCH_BUCKET, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION).
A peer that is not installed gives {"error": "..."}.
"""
import json
import os
import subprocess
import sys
import time

MIB = 1 << 20

# name -> what it reads: "object" (raw bytes to host), "checkpoint" (tensors on the CPU) or
# "checkpoint-gpu" (tensors on cuda:0; only where the bench says there is a GPU, with
# GPUFEED_BENCH_GPU=1).
PEERS = {
    "gpufeed.read_object": "object",
    "boto3 download_fileobj (TransferConfig 8 MiB x 16)": "object",
    "obstore get": "object",
    "Run:ai Model Streamer, tensors on the CPU": "checkpoint",
    "gpufeed.load_safetensors(url, device=0)": "checkpoint-gpu",
    "Run:ai Model Streamer, each tensor .to(cuda:0)": "checkpoint-gpu",
}


def _reader(name, bucket, endpoint):
    """A function reading ``key`` whole with peer ``name``, returning the bytes read."""
    if name.startswith("gpufeed.load_safetensors"):
        import gpufeed
        import torch

        def read(key):
            tensors = gpufeed.load_safetensors(f"s3://{bucket}/{key}", device=0)
            torch.cuda.synchronize()
            return sum(t.numel() * t.element_size() for t in tensors.values())
        return read
    if name.startswith("gpufeed"):
        import gpufeed

        return lambda key: len(gpufeed.read_object(f"s3://{bucket}/{key}"))
    if name.startswith("boto3"):
        import io

        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        s3 = boto3.client("s3", endpoint_url=endpoint,
                          config=Config(s3={"addressing_style": "path"}))
        cfg = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB,
                             max_concurrency=16)

        def read(key):
            buf = io.BytesIO()
            s3.download_fileobj(bucket, key, buf, Config=cfg)
            return buf.getbuffer().nbytes
        return read
    if name.startswith("obstore"):
        import obstore
        from obstore.store import S3Store

        store = S3Store(bucket, endpoint=endpoint, region=os.environ.get("AWS_REGION"),
                        client_options={"allow_http": True})
        return lambda key: len(obstore.get(store, key).bytes())
    if name.startswith("Run:ai"):
        os.environ.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        from runai_model_streamer import SafetensorsStreamer

        # To the GPU as vLLM's runai_streamer load does without distributed streaming: the
        # streamer's CPU tensors, each copied to the device as it arrives.
        to_gpu = "cuda" in name
        if to_gpu:
            import torch

        def read(key):
            n, kept = 0, []
            with SafetensorsStreamer() as streamer:
                streamer.stream_file(f"s3://{bucket}/{key}")
                for _, tensor in streamer.get_tensors():
                    n += tensor.numel() * tensor.element_size()
                    if to_gpu:
                        kept.append(tensor.to("cuda:0"))
            if to_gpu:
                torch.cuda.synchronize()
            return n
        return read
    raise SystemExit(f"unknown peer {name}")


def _one(name, key):
    bucket = os.environ["GPUFEED_BENCH_BUCKET"]
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    seconds = []
    if PEERS[name] == "checkpoint-gpu":
        # torch's CUDA context before the clock, for every GPU row alike (a serving process
        # has one already).
        import torch

        torch.zeros(1, device="cuda:0")
        torch.cuda.synchronize()
    start = time.perf_counter()
    read = _reader(name, bucket, endpoint)
    for _ in range(2):
        n = read(key)
        seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
    return {"bytes": n, "seconds": seconds}


def main():
    if sys.argv[1] == "--one":
        print(json.dumps(_one(sys.argv[2], sys.argv[3])))
        return
    reps, object_key, checkpoint_key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    rows = {}
    gpu = os.environ.get("GPUFEED_BENCH_GPU") == "1"
    for name, kind in PEERS.items():
        if kind == "checkpoint-gpu" and not gpu:
            continue
        key = object_key if kind == "object" else checkpoint_key
        fresh, again, nbytes, error = [], [], 0, None
        for _ in range(reps):
            out = subprocess.run([sys.executable, __file__, "--one", name, key],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                lines = (out.stderr or "failed").strip().splitlines()
                error = lines[-1] if lines else "failed"
                break
            r = json.loads(out.stdout)
            nbytes = r["bytes"]
            fresh.append(nbytes / r["seconds"][0] / 1e9)
            again.append(nbytes / r["seconds"][1] / 1e9)
        rows[name] = {"error": error} if error else {
            "fresh": fresh, "again": again, "bytes": nbytes, "reads": kind}
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
