#!/usr/bin/env python3
"""nvJPEG's hardware batched decode alone, through ctypes (no gpufeed code; device memory from
torch): whole images against each image's RandomResizedCrop region (nvjpegDecodeBatchedEx with
nvjpegDecodeParamsSetROI), the batch in the sampler's order against largest first, and
nvjpegDecodeBatchedPreAllocate; 1, 3 and 6 threads, each with its own handle. Not run by the
bench: docs/benchmarks.md, GPU run 189, is what it measured (issue 40).

Usage: python3 benches/peers/nvjpeg_order.py    (N=2048 images from images.py's generator,
LIKE=imagenet (default) or issue40 its data set; NVJPEG=path overrides libnvjpeg.so.13;
FORMATS=1: only the output formats compared, interleaved RGB (gpufeed's), planar RGB and YUV as
stored, three threads, largest first, after checking the YUV output converted to RGB here
against nvJPEG's own RGB). Prints images/s per setting (median of 3 passes) and
whether the ROI output equals the whole decode's crop.
"""
import ctypes as C, math, os, sys, threading, time, random
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np, torch
from multiprocessing import Pool
import images as gen

N = int(os.environ.get("N", "2048")); B = 256
LIKE = os.environ.get("LIKE", "imagenet")
def mk(i): return gen._jpeg(40, i, LIKE)
with Pool(16) as p: data = p.map(mk, range(N))
jpegs = [d[0] for d in data]
print(f"made {N} JPEGs, mean {sum(map(len,jpegs))/N/1024:.1f} KiB", flush=True)
lib = C.CDLL(os.environ.get("NVJPEG", "libnvjpeg.so.13"))
class Img(C.Structure): _fields_ = [("channel", C.c_void_p*4), ("pitch", C.c_size_t*4)]
def ck(r, what):
    if r != 0: raise RuntimeError(f"{what} -> status {r}")
torch.cuda.init(); torch.empty(1, device="cuda")
def info(h, j):
    nc, ss = C.c_int(), C.c_int(); W = (C.c_int*4)(); H = (C.c_int*4)()
    ck(lib.nvjpegGetImageInfo(h, j, C.c_size_t(len(j)), C.byref(nc), C.byref(ss), W, H), "info")
    return W[0], H[0]
def rrc(rng, W, H):
    area = W*H
    for _ in range(10):
        ta = area*rng.uniform(0.08, 1.0); ar = math.exp(rng.uniform(math.log(3/4), math.log(4/3)))
        w = int(round(math.sqrt(ta*ar))); h = int(round(math.sqrt(ta/ar)))
        if 0 < w <= W and 0 < h <= H: return rng.randint(0, W-w), rng.randint(0, H-h), w, h
    return 0, 0, W, H
# nvjpegOutputFormat_t: 5 interleaved RGB (what gpufeed asks for), 3 planar RGB, 1 YUV as
# stored (planes at the JPEG's own subsampling: every image here is 4:2:0).
FMT = {"full": 5, "ex-full": 5, "roi": 5, "rgb-planar": 3, "yuv": 1}
def planes(fmt, w, h):
    """(width, height) of each output plane of a `w` x `h` image in format `fmt`."""
    if fmt == 5: return [(w * 3, h)]
    if fmt == 3: return [(w, h)] * 3
    return [(w, h), ((w + 1) // 2, (h + 1) // 2), ((w + 1) // 2, (h + 1) // 2)]
class Dec:
    def __init__(s, fmt=5):
        s.fmt = fmt
        s.h = C.c_void_p(); ck(lib.nvjpegCreateEx(3, None, None, 0, C.byref(s.h)), "create hw")
        s.st = C.c_void_p(); ck(lib.nvjpegJpegStateCreate(s.h, C.byref(s.st)), "state")
        ck(lib.nvjpegDecodeBatchedInitialize(s.h, s.st, B, 1, fmt), "init")
        e, c = C.c_uint(), C.c_uint(); lib.nvjpegGetHardwareDecoderInfo(s.h, C.byref(e), C.byref(c)); s.engines = (e.value, c.value)
        s.stream = torch.cuda.Stream(); s.params = []
        for _ in range(B):
            p = C.c_void_p(); ck(lib.nvjpegDecodeParamsCreate(s.h, C.byref(p)), "params"); ck(lib.nvjpegDecodeParamsSetOutputFormat(p, 5), "fmt"); s.params.append(p)
    def prealloc(s, w, h): ck(lib.nvjpegDecodeBatchedPreAllocate(s.h, s.st, B, w, h, 0, 5), "prealloc")
    def run(s, batch, rois, mode):
        n = len(batch)
        if n != B: ck(lib.nvjpegDecodeBatchedInitialize(s.h, s.st, n, 1, s.fmt), "init")
        dims = [(r[2], r[3]) for r in rois] if mode == "roi" else [(r[4], r[5]) for r in rois]
        sizes = [sum((pw*ph+255)//256*256 for pw, ph in planes(s.fmt, w, h)) for w, h in dims]
        offs = np.cumsum([0]+sizes)
        buf = torch.empty(int(offs[-1]), dtype=torch.uint8, device="cuda")
        base = buf.data_ptr(); imgs = (Img*n)()
        for i, (w, h) in enumerate(dims):
            at = base+int(offs[i])
            for c, (pw, ph) in enumerate(planes(s.fmt, w, h)):
                imgs[i].channel[c] = at; imgs[i].pitch[c] = pw; at += (pw*ph+255)//256*256
        ptrs = (C.c_char_p*n)(*batch); lens = (C.c_size_t*n)(*[len(j) for j in batch])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if mode == "roi":
            for i, r in enumerate(rois): ck(lib.nvjpegDecodeParamsSetROI(s.params[i], r[0], r[1], r[2], r[3]), "roi")
            pa = (C.c_void_p*n)(*[p.value for p in s.params[:n]])
            ck(lib.nvjpegDecodeBatchedEx(s.h, s.st, ptrs, lens, imgs, pa, C.c_void_p(s.stream.cuda_stream)), "batchedEx")
        elif mode == "ex-full":
            for i, r in enumerate(rois): ck(lib.nvjpegDecodeParamsSetROI(s.params[i], 0, 0, -1, -1), "roi0")
            pa = (C.c_void_p*n)(*[p.value for p in s.params[:n]])
            ck(lib.nvjpegDecodeBatchedEx(s.h, s.st, ptrs, lens, imgs, pa, C.c_void_p(s.stream.cuda_stream)), "batchedEx full")
        else:
            ck(lib.nvjpegDecodeBatched(s.h, s.st, ptrs, lens, imgs, C.c_void_p(s.stream.cuda_stream)), "batched")
        t1 = time.perf_counter(); s.stream.synchronize(); t2 = time.perf_counter()
        if n != B: ck(lib.nvjpegDecodeBatchedInitialize(s.h, s.st, B, 1, s.fmt), "init")
        return buf, offs, dims, t1-t0, t2-t1
probe = Dec(); print("engines, cores:", probe.engines, flush=True)
rng = random.Random(7); meta = []
for j in jpegs:
    W, H = info(probe.h, j); x, y, w, h = rrc(rng, W, H); meta.append((x, y, w, h, W, H))
frac = sum(m[2]*m[3] for m in meta)/sum(m[4]*m[5] for m in meta)
print(f"ROI share of pixels {frac:.3f}; of rows to the crop's bottom {sum((m[1]+m[3])*m[4] for m in meta)/sum(m[4]*m[5] for m in meta):.3f}", flush=True)
# correctness: ROI vs full decode cropped, first batch
bf, of, df, *_ = probe.run(jpegs[:B], meta[:B], "full"); br, orr, dr, *_ = probe.run(jpegs[:B], meta[:B], "roi")
mx = 0; eq = 0
for i in range(B):
    x, y, w, h, W, H = meta[i]
    full = bf[int(of[i]):int(of[i])+W*H*3].view(H, W, 3)[y:y+h, x:x+w].int()
    roi = br[int(orr[i]):int(orr[i])+w*h*3].view(h, w, 3).int()
    d = (full-roi).abs().max().item(); mx = max(mx, d); eq += d == 0
print(f"ROI vs full cropped: max diff {mx}, {eq}/{B} identical", flush=True)
def bench(mode, threads, order=None, pre=None, reps=3):
    decs = [Dec(FMT[mode]) for _ in range(threads)]
    if pre:
        for d in decs: d.prealloc(*pre)
    idx = list(range(N))
    if order == "sort": 
        batches = []
        for k in range(0, N, B):
            b = sorted(idx[k:k+B], key=lambda i: -meta[i][4]*meta[i][5]); batches.append(b)
    else: batches = [idx[k:k+B] for k in range(0, N, B)]
    res = []
    for rep in range(reps+1):
        host = [0.0]*threads; gpu = [0.0]*threads; q = list(range(len(batches))); lock = threading.Lock()
        def work(t):
            while True:
                with lock:
                    if not q: return
                    k = q.pop(0)
                b = batches[k]
                _, _, _, th, tg = decs[t].run([jpegs[i] for i in b], [meta[i] for i in b], mode)
                host[t] += th; gpu[t] += tg
        t0 = time.perf_counter(); ths = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        [x.start() for x in ths]; [x.join() for x in ths]; el = time.perf_counter()-t0
        if rep: res.append((N/el, sum(host)/threads/el, sum(gpu)/threads/el))
    r = sorted(res)[len(res)//2]
    print(f"{mode:8s} threads={threads} order={order} pre={pre}: {r[0]:8.0f} img/s  (host in call {r[1]:.2f}, waiting {r[2]:.2f} of wall per thread) all={[round(x[0]) for x in res]}", flush=True)
maxw = max(m[4] for m in meta); maxh = max(m[5] for m in meta)
def yuv_check():
    """The first batch as stored (YUV) converted here (JFIF's full-range BT.601, chroma
    upsampled by replication and by the triangle filter, i.e. bilinear at half-pixel
    centres) against nvJPEG's own interleaved RGB: how far each is, per channel."""
    import torch.nn.functional as F
    bf, of, df, *_ = probe.run(jpegs[:B], meta[:B], "full")
    by, oy, dy, *_ = Dec(FMT["yuv"]).run(jpegs[:B], meta[:B], "yuv")
    worst = {"replicated": 0, "triangle": 0}; over1 = {"replicated": 0, "triangle": 0}; px = 0
    for i in range(B):
        W, H = meta[i][4], meta[i][5]
        rgb = bf[int(of[i]):int(of[i]) + W * H * 3].view(H, W, 3).float()
        at = int(oy[i]); pl = []
        for pw, ph in planes(1, W, H):
            pl.append(by[at:at + pw * ph].view(ph, pw).float()); at += (pw * ph + 255) // 256 * 256
        y, cb, cr = pl
        for how in worst:
            if how == "replicated":
                up = lambda c: c.repeat_interleave(2, 0).repeat_interleave(2, 1)[:H, :W]
            else:
                up = lambda c: F.interpolate(c[None, None], scale_factor=2, mode="bilinear", align_corners=False)[0, 0][:H, :W]
            u, v = up(cb) - 128, up(cr) - 128
            mine = torch.stack([y + 1.402 * v, y - 0.344136 * u - 0.714136 * v, y + 1.772 * u], -1).round().clamp(0, 255)
            d = (mine - rgb).abs()
            worst[how] = max(worst[how], d.max().item()); over1[how] += (d > 1).sum().item()
        px += W * H * 3
    for how in worst:
        print(f"YUV converted here ({how} chroma) against nvJPEG's RGB: max diff {worst[how]:.0f}, "
              f"{over1[how] / px:.5f} of values off by more than 1", flush=True)
if os.environ.get("FORMATS"):
    # Only the output formats, three threads, largest first, twice each (FORMATS=1); first,
    # whether nvJPEG's RGB can be had from its YUV output.
    try: yuv_check()
    except Exception as e: print("yuv check failed:", e, flush=True)
    for _ in range(2):
        for mode in ("full", "rgb-planar", "yuv"):
            try: bench(mode, 3, order="sort")
            except Exception as e: print(mode, "failed:", e, flush=True)
    sys.exit(0)
for threads in (1, 3):
    for mode in ("full", "ex-full", "roi"):
        try: bench(mode, threads)
        except Exception as e: print(mode, threads, "failed:", e, flush=True)
try: bench("full", 3, order="sort")
except Exception as e: print("sort failed", e)
try: bench("full", 3, pre=(maxw, maxh)); bench("roi", 3, pre=(maxw, maxh))
except Exception as e: print("prealloc failed", e)
try: bench("roi", 6)
except Exception as e: print("roi 6 failed", e)
