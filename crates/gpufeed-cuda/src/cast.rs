//! Casts between floating types on the GPU, on the way of a load: BF16, F16 and F32 to one
//! another, FP8 (E4M3, E5M2) to each of them. The kernels are PTX text compiled by the
//! driver's JIT when [`CastKernel::load`] runs ([`crate::kernels`]' path: no toolkit, no
//! NVRTC).
//!
//! Every value comes out as torch's `.to(dtype)` on a CUDA device of compute capability 8.0
//! or newer gives it, bit for bit: rounding to nearest, ties to even, subnormals kept, and
//! the NaNs as torch's CUDA kernels make them (measured on an H200 with torch 2.11: a NaN cast
//! to F16 or BF16 becomes `0x7FFF` whatever its sign and payload; F16 to F32 makes `0x7FFFFFFF`;
//! BF16 to F32 keeps every bit; an FP8 NaN to F32 keeps its sign, `0x7FF00000` for E4M3 and
//! `0x7FFFFFFF` for E5M2). [`reference()`] is the same arithmetic on the CPU. torch's CPU
//! kernels make other NaNs (`0xFFFF` for F32 to BF16 in torch 2.15's vector path): compare a
//! GPU cast with torch on the GPU.
//!
//! The kernels read a source at any address (a tensor at an odd offset of a checkpoint's
//! staging) and write an element-aligned destination.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::{Error, Gpu, Result};

/// A floating type the cast kernels read or write, by safetensors' name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CastType {
    /// IEEE binary32 (`F32`).
    F32,
    /// IEEE binary16 (`F16`).
    F16,
    /// bfloat16 (`BF16`).
    BF16,
    /// FP8 E4M3 with no infinities (`F8_E4M3`, torch's `float8_e4m3fn`): read only.
    F8E4M3,
    /// FP8 E5M2 (`F8_E5M2`, torch's `float8_e5m2`): read only.
    F8E5M2,
}

/// Every [`CastType`].
const TYPES: [CastType; 5] = CastType::ALL;

impl CastType {
    /// Every type the kernels read, in this order: F32, F16, BF16, F8_E4M3, F8_E5M2.
    pub const ALL: [CastType; 5] = [
        CastType::F32,
        CastType::F16,
        CastType::BF16,
        CastType::F8E4M3,
        CastType::F8E5M2,
    ];

    /// The type safetensors names `name` (`"BF16"`, `"F8_E4M3"`...), where casts take it.
    pub fn from_safetensors(name: &str) -> Option<CastType> {
        TYPES.into_iter().find(|t| t.name() == name)
    }

    /// Its safetensors name.
    pub fn name(self) -> &'static str {
        match self {
            CastType::F32 => "F32",
            CastType::F16 => "F16",
            CastType::BF16 => "BF16",
            CastType::F8E4M3 => "F8_E4M3",
            CastType::F8E5M2 => "F8_E5M2",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            CastType::F32 => 4,
            CastType::F16 | CastType::BF16 => 2,
            CastType::F8E4M3 | CastType::F8E5M2 => 1,
        }
    }

    /// Whether casts write this type (FP8 is only read).
    fn writable(self) -> bool {
        matches!(self, CastType::F32 | CastType::F16 | CastType::BF16)
    }

    /// The name of the type in the kernels' entry names.
    fn tag(self) -> &'static str {
        match self {
            CastType::F32 => "f32",
            CastType::F16 => "f16",
            CastType::BF16 => "bf16",
            CastType::F8E4M3 => "e4m3",
            CastType::F8E5M2 => "e5m2",
        }
    }
}

impl std::fmt::Display for CastType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the kernels cast `from` to `to`: BF16, F16 and F32 to one another, and FP8 (E4M3,
/// E5M2) to each of those. A type to itself is no cast (copy it).
pub fn can_cast(from: CastType, to: CastType) -> bool {
    from != to && to.writable()
}

/// What [`can_cast`] says no to, as an error that lists what the kernels do.
fn unsupported(from: CastType, to: CastType) -> Error {
    let reason = if from == to {
        "the same type: copy the bytes instead".to_owned()
    } else {
        "the kernels cast BF16, F16 and F32 to one another and F8_E4M3 / F8_E5M2 to each of \
         those; cast after loading for other pairs"
            .to_owned()
    };
    Error::CastUnsupported {
        from: from.name().to_owned(),
        to: to.name().to_owned(),
        reason,
    }
}

/// `src` (elements of `from`, little-endian, any length a multiple of its size) cast to `to`
/// on the CPU, with the GPU kernels' arithmetic: the bytes [`CastKernel`] writes, and torch's
/// CUDA `.to(dtype)` on compute capability 8.0+ (see the module).
///
/// # Errors
/// [`Error::CastUnsupported`] for a pair the kernels do not cast; [`Error::OutOfBounds`] when
/// `src`'s length is not whole elements.
pub fn reference(from: CastType, to: CastType, src: &[u8]) -> Result<Vec<u8>> {
    if !can_cast(from, to) {
        return Err(unsupported(from, to));
    }
    if !src.len().is_multiple_of(from.size()) {
        return Err(Error::OutOfBounds {
            len: src.len() as u64,
            offset: 0,
            capacity: (src.len() - src.len() % from.size()) as u64,
        });
    }
    let mut out = Vec::with_capacity(src.len() / from.size() * to.size());
    for e in src.chunks_exact(from.size()) {
        let mut raw = [0u8; 4];
        raw[..e.len()].copy_from_slice(e);
        let bits = to_f32_bits(from, u32::from_le_bytes(raw));
        match to {
            CastType::F32 => out.extend_from_slice(&bits.to_le_bytes()),
            CastType::BF16 => out.extend_from_slice(&f32_to_bf16(bits).to_le_bytes()),
            CastType::F16 => out.extend_from_slice(&f32_to_f16(bits).to_le_bytes()),
            CastType::F8E4M3 | CastType::F8E5M2 => return Err(unsupported(from, to)),
        }
    }
    Ok(out)
}

/// The F32 bits of the source element `v` (its bits in the low end), as the kernels widen it.
fn to_f32_bits(from: CastType, v: u32) -> u32 {
    match from {
        CastType::F32 => v,
        CastType::BF16 => v << 16,
        CastType::F16 => f16_to_f32(v as u16),
        CastType::F8E4M3 => {
            let (sign, mag) = ((v & 0x80) << 24, v & 0x7f);
            let bits = if mag == 0x7f {
                0x7ff0_0000
            } else if mag < 8 {
                (mag as f32 * f32::from_bits(0x3b00_0000)).to_bits()
            } else {
                (mag << 20) + (120 << 23)
            };
            sign | bits
        }
        CastType::F8E5M2 => {
            let sign = (v & 0x80) << 24;
            if v & 0x7f > 0x7c {
                sign | 0x7fff_ffff
            } else {
                f16_to_f32((v << 8) as u16)
            }
        }
    }
}

/// F16 to F32 bits, exactly; a NaN becomes `0x7FFFFFFF` (the GPU's `cvt.f32.f16`).
fn f16_to_f32(h: u16) -> u32 {
    let sign = u32::from(h & 0x8000) << 16;
    let (exp, man) = (u32::from(h >> 10) & 0x1f, u32::from(h) & 0x3ff);
    match (exp, man) {
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, _) => 0x7fff_ffff,
        (0, 0) => sign,
        // A subnormal: man * 2^-24, exact in F32.
        (0, _) => sign | (man as f32 * f32::from_bits(0x3380_0000)).to_bits(),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    }
}

/// F32 bits to BF16, to nearest, ties to even; a NaN becomes `0x7FFF`.
fn f32_to_bf16(x: u32) -> u16 {
    if x & 0x7fff_ffff > 0x7f80_0000 {
        return 0x7fff;
    }
    ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
}

/// F32 bits to F16, to nearest, ties to even, subnormals kept; a NaN becomes `0x7FFF`.
fn f32_to_f16(x: u32) -> u16 {
    let sign = ((x >> 16) & 0x8000) as u16;
    let abs = x & 0x7fff_ffff;
    if abs > 0x7f80_0000 {
        return 0x7fff;
    }
    // 65520 and up round to infinity.
    if abs >= 0x477f_f000 {
        return sign | 0x7c00;
    }
    // A normal F16 (2^-14 and up): rebias the exponent, round off 13 bits.
    if abs >= 0x3880_0000 {
        let m = abs - (112 << 23);
        return sign | ((m + 0xfff + ((m >> 13) & 1)) >> 13) as u16;
    }
    // Below 2^-25 (and 2^-25 itself, a tie) rounds to zero.
    let exp = abs >> 23;
    if exp < 102 {
        return sign;
    }
    // A subnormal result: the significand in units of 2^-24.
    let man = (abs & 0x7f_ffff) | 0x80_0000;
    let shift = 126 - exp;
    let (q, rem, half) = (man >> shift, man & ((1 << shift) - 1), 1 << (shift - 1));
    let q = if rem > half || (rem == half && q & 1 == 1) {
        q + 1
    } else {
        q
    };
    sign | q as u16
}

/// Threads per block of the cast kernels.
const BLOCK: u32 = 256;
/// The most blocks a launch takes (each thread loops over the elements a grid apart).
const MAX_BLOCKS: u32 = 8192;

/// How a cast kernel reads its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    /// Whole elements at element-aligned addresses.
    Aligned,
    /// Byte by byte (a source at any address).
    Bytes,
    /// Byte by byte, in runs of `width` elements `pitch` bytes apart (a column part in a
    /// staging): element `i` at `src + (i / width) * pitch + (i % width) * size`.
    Pitched,
}

impl Read {
    /// The reads a kernel of a source of `size`-byte elements is made with (one-byte
    /// elements are always aligned).
    fn all(size: usize) -> &'static [Read] {
        if size == 1 {
            &[Read::Aligned, Read::Pitched]
        } else {
            &[Read::Aligned, Read::Bytes, Read::Pitched]
        }
    }
}

/// The name of the kernel casting `from` to `to` with reads `read`.
fn entry_name(from: CastType, to: CastType, read: Read) -> String {
    let tag = match read {
        Read::Aligned => "a",
        Read::Bytes => "u",
        Read::Pitched => "p",
    };
    format!("cast_{}_{}_{tag}", from.tag(), to.tag())
}

/// Every entry's (from, to, read).
fn entries() -> impl Iterator<Item = (CastType, CastType, Read)> {
    TYPES.into_iter().flat_map(|from| {
        TYPES
            .into_iter()
            .filter(move |&to| can_cast(from, to))
            .flat_map(move |to| Read::all(from.size()).iter().map(move |&r| (from, to, r)))
    })
}

/// The PTX of every cast kernel: one entry per pair and way of reading. `cvt.rn.bf16.f32`
/// needs `sm_80` and ISA 7.0.
fn ptx() -> String {
    let mut s = String::from(".version 7.0\n.target sm_80\n.address_size 64\n");
    for (from, to, read) in entries() {
        entry(&mut s, from, to, read);
    }
    s
}

/// Appends the entry `entry_name(from, to, read)(src, dst, n, width, pitch)`: element `i` of
/// `n` read at `src + i * size(from)` (pitched: see [`Read::Pitched`]; `width` and `pitch`
/// are read by pitched entries only), written at `dst + i * size(to)`, each thread taking the
/// elements a grid apart. `%r5` holds the source bits, `%r6` the F32 bits.
fn entry(s: &mut String, from: CastType, to: CastType, read: Read) {
    let (ss, ds) = (from.size(), to.size());
    let name = entry_name(from, to, read);
    let _ = write!(
        s,
        "
.visible .entry {name}(
    .param .u64 src,
    .param .u64 dst,
    .param .u64 n,
    .param .u64 width,
    .param .u64 pitch
)
{{
    .reg .pred %p<3>;
    .reg .b16 %h<3>;
    .reg .b32 %r<12>;
    .reg .f32 %f<3>;
    .reg .b64 %rd<14>;

    ld.param.u64 %rd1, [src];
    ld.param.u64 %rd2, [dst];
    ld.param.u64 %rd3, [n];
    ld.param.u64 %rd10, [width];
    ld.param.u64 %rd11, [pitch];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    mov.u32 %r4, %nctaid.x;
    mul.wide.u32 %rd6, %r4, %r2;
{name}_LOOP:
    setp.ge.u64 %p1, %rd4, %rd3;
    @%p1 bra {name}_DONE;
"
    );
    if read == Read::Pitched {
        // row = i / width, col = i - row * width: src + row * pitch + col * size.
        let _ = write!(
            s,
            "    div.u64 %rd12, %rd4, %rd10;
    mul.lo.u64 %rd13, %rd12, %rd10;
    sub.u64 %rd13, %rd4, %rd13;
    mul.lo.u64 %rd7, %rd12, %rd11;
    mul.lo.u64 %rd13, %rd13, {ss};
    add.u64 %rd7, %rd7, %rd13;
    add.u64 %rd7, %rd7, %rd1;
"
        );
    } else {
        let _ = write!(
            s,
            "    mul.lo.u64 %rd7, %rd4, {ss};\n    add.u64 %rd7, %rd7, %rd1;\n"
        );
    }
    let aligned = read == Read::Aligned;
    // The source element's bits into %r5.
    match (ss, aligned) {
        (1, _) => s.push_str("    ld.global.u8 %r5, [%rd7];\n"),
        (2, true) => s.push_str("    ld.global.u16 %r5, [%rd7];\n"),
        (4, true) => s.push_str("    ld.global.b32 %r5, [%rd7];\n"),
        (n, _) => {
            s.push_str("    ld.global.u8 %r5, [%rd7];\n");
            for k in 1..n {
                let _ = write!(
                    s,
                    "    ld.global.u8 %r7, [%rd7+{k}];\n    shl.b32 %r7, %r7, {};\n    or.b32 %r5, %r5, %r7;\n",
                    8 * k
                );
            }
        }
    }
    // Widened to F32 bits in %r6.
    s.push_str(match from {
        CastType::F32 => "    mov.b32 %r6, %r5;\n",
        CastType::BF16 => "    shl.b32 %r6, %r5, 16;\n",
        CastType::F16 => {
            "    cvt.u16.u32 %h1, %r5;\n    cvt.f32.f16 %f1, %h1;\n    mov.b32 %r6, %f1;\n"
        }
        // sign | (mag < 8 ? mag * 2^-9 : (mag << 20) + (120 << 23)), NaN (mag 0x7f) 0x7FF00000.
        CastType::F8E4M3 => {
            "    and.b32 %r7, %r5, 127;
    and.b32 %r8, %r5, 128;
    shl.b32 %r8, %r8, 24;
    cvt.rn.f32.u32 %f1, %r7;
    mul.rn.f32 %f1, %f1, 0f3B000000;
    mov.b32 %r9, %f1;
    shl.b32 %r10, %r7, 20;
    add.u32 %r10, %r10, 1006632960;
    setp.lt.u32 %p2, %r7, 8;
    selp.b32 %r6, %r9, %r10, %p2;
    setp.eq.u32 %p2, %r7, 127;
    mov.b32 %r11, 2146435072;
    selp.b32 %r6, %r11, %r6, %p2;
    or.b32 %r6, %r6, %r8;
"
        }
        // The F16 of its bits << 8, exactly; NaN (mag > 0x7c) sign | 0x7FFFFFFF.
        CastType::F8E5M2 => {
            "    and.b32 %r7, %r5, 127;
    and.b32 %r8, %r5, 128;
    shl.b32 %r8, %r8, 24;
    shl.b32 %r9, %r5, 8;
    cvt.u16.u32 %h1, %r9;
    cvt.f32.f16 %f1, %h1;
    mov.b32 %r6, %f1;
    setp.gt.u32 %p2, %r7, 124;
    or.b32 %r9, %r8, 2147483647;
    selp.b32 %r6, %r9, %r6, %p2;
"
        }
    });
    let _ = write!(
        s,
        "    mul.lo.u64 %rd8, %rd4, {ds};\n    add.u64 %rd8, %rd8, %rd2;\n"
    );
    s.push_str(match to {
        CastType::BF16 => {
            "    mov.b32 %f2, %r6;\n    cvt.rn.bf16.f32 %h2, %f2;\n    st.global.b16 [%rd8], %h2;\n"
        }
        CastType::F16 => {
            "    mov.b32 %f2, %r6;\n    cvt.rn.f16.f32 %h2, %f2;\n    st.global.b16 [%rd8], %h2;\n"
        }
        _ => "    st.global.b32 [%rd8], %r6;\n",
    });
    let _ = write!(
        s,
        "    add.u64 %rd4, %rd4, %rd6;\n    bra {name}_LOOP;\n{name}_DONE:\n    ret;\n}}\n"
    );
}

/// The cast kernels, compiled for one GPU.
///
/// # Example
/// ```
/// use gpufeed_cuda::{Gpu, cast::{CastKernel, CastType}};
/// let gpu = match Gpu::open(0) {
///     Ok(gpu) => gpu,
///     Err(e) if e.is_no_gpu() => return Ok(()), // a machine without a GPU
///     Err(e) => return Err(e.into()),
/// };
/// let kernel = CastKernel::load(&gpu)?;
/// let stream = gpu.default_stream();
/// // 1.0, -2.5 and a tie (1 + 2^-8 rounds to 1.0) as F32, to BF16.
/// let values: Vec<u8> = [1.0f32, -2.5, 1.00390625].iter().flat_map(|v| v.to_le_bytes()).collect();
/// let src = stream.clone_htod(&values)?;
/// let mut dst = stream.alloc_zeros::<u8>(6)?;
/// kernel.launch(&stream, CastType::F32, &src.slice(..), CastType::BF16, &mut dst.slice_mut(..))?;
/// assert_eq!(stream.clone_dtoh(&dst)?, [0x80, 0x3f, 0x20, 0xc0, 0x80, 0x3f]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct CastKernel {
    funcs: Arc<HashMap<String, CudaFunction>>,
}

impl CastKernel {
    /// Compiles the kernels for `gpu` (the driver's JIT, once per process and GPU is enough:
    /// the value is cheap to clone).
    ///
    /// # Errors
    /// [`Error::CastUnsupported`] on a GPU older than compute capability 8.0 (no BF16
    /// conversion instructions); [`Error::Cuda`] naming `cuModuleLoadData` where the driver
    /// refuses the PTX (older than CUDA 11).
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let (major, minor) = gpu.info().compute_capability;
        if major < 8 {
            return Err(Error::CastUnsupported {
                from: "any".to_owned(),
                to: "any".to_owned(),
                reason: format!(
                    "GPU {} ({}) has compute capability {major}.{minor}; the cast kernels need \
                     8.0 or newer: cast after loading",
                    gpu.info().ordinal,
                    gpu.info().name
                ),
            });
        }
        let module = gpu
            .context()
            .load_module(Ptx::from_src(ptx()))
            .map_err(|e| Error::cuda("cuModuleLoadData (the cast kernels' PTX)", e))?;
        let mut funcs = HashMap::new();
        for (from, to, read) in entries() {
            let name = entry_name(from, to, read);
            let func = module
                .load_function(&name)
                .map_err(|e| Error::cuda("cuModuleGetFunction", e))?;
            funcs.insert(name, func);
        }
        Ok(CastKernel {
            funcs: Arc::new(funcs),
        })
    }

    /// Queues on `stream` the cast of `src` (elements of `from`) into `dst` (as many elements
    /// of `to`).
    ///
    /// # Errors
    /// [`Error::CastUnsupported`] for a pair [`can_cast`] refuses; [`Error::OutOfBounds`]
    /// when `src` is not whole elements or `dst` is not as many elements of `to`;
    /// [`Error::Cuda`] for a refused launch.
    pub fn launch(
        &self,
        stream: &Arc<CudaStream>,
        from: CastType,
        src: &CudaView<'_, u8>,
        to: CastType,
        dst: &mut CudaViewMut<'_, u8>,
    ) -> Result<()> {
        if !can_cast(from, to) {
            return Err(unsupported(from, to));
        }
        let n = src.len() / from.size();
        if !src.len().is_multiple_of(from.size()) || dst.len() != n * to.size() {
            return Err(Error::OutOfBounds {
                len: (n * to.size()) as u64,
                offset: 0,
                capacity: dst.len() as u64,
            });
        }
        let (s, _read) = src.device_ptr(stream);
        let (d, _write) = dst.device_ptr_mut(stream);
        // SAFETY: `s` is `n` elements of `from` that `src` holds, `d` `n` elements of `to` that
        // `dst` holds (both checked above), both of `stream`'s context, their use recorded on
        // `stream` by cudarc for the work queued here.
        unsafe { self.launch_raw(stream, from, s, to, d, n as u64) }
    }

    /// [`CastKernel::launch`] by device addresses: `n` elements of `from` at `src` (any
    /// address) cast into `n` elements of `to` at `dst`.
    ///
    /// # Safety
    /// `src .. src + n * from.size()` must be device memory readable and `dst .. dst + n *
    /// to.size()` device memory writable by `stream`'s context until the work queued on
    /// `stream` now has run, nothing else writing either meanwhile; `dst` must be a multiple
    /// of `to.size()`.
    ///
    /// # Errors
    /// [`Error::CastUnsupported`] for a pair [`can_cast`] refuses, or a `dst` that is not
    /// element-aligned; [`Error::Cuda`] for a refused launch.
    pub unsafe fn launch_raw(
        &self,
        stream: &Arc<CudaStream>,
        from: CastType,
        src: u64,
        to: CastType,
        dst: u64,
        n: u64,
    ) -> Result<()> {
        let read = if src.is_multiple_of(from.size() as u64) {
            Read::Aligned
        } else {
            Read::Bytes
        };
        // SAFETY: passed on (one run of `n` elements is the same memory).
        unsafe { self.run(stream, from, src, to, dst, n, read, (n.max(1), 0)) }
    }

    /// [`CastKernel::launch_raw`] of `runs` runs of `width` elements of `from`, `pitch` bytes
    /// apart from `src` on (any address), into `runs * width` elements of `to` back to back
    /// at `dst`: the columns of a matrix, cast into a contiguous one.
    ///
    /// # Safety
    /// Every run `src + r * pitch .. + width * from.size()` must be device memory readable,
    /// and `dst .. dst + runs * width * to.size()` writable, as for
    /// [`CastKernel::launch_raw`].
    ///
    /// # Errors
    /// [`CastKernel::launch_raw`]'s, and [`Error::OutOfBounds`] for runs wider than their
    /// pitch.
    #[allow(clippy::too_many_arguments, reason = "a pitched copy's fields")]
    pub unsafe fn launch_pitched_raw(
        &self,
        stream: &Arc<CudaStream>,
        from: CastType,
        src: u64,
        pitch: u64,
        to: CastType,
        dst: u64,
        runs: u64,
        width: u64,
    ) -> Result<()> {
        if width * from.size() as u64 > pitch && runs > 1 {
            return Err(Error::OutOfBounds {
                len: width * from.size() as u64,
                offset: 0,
                capacity: pitch,
            });
        }
        // SAFETY: passed on.
        unsafe {
            self.run(
                stream,
                from,
                src,
                to,
                dst,
                runs * width,
                Read::Pitched,
                (width.max(1), pitch),
            )
        }
    }

    /// Checks the pair and the destination, then launches the entry for `read` over `n`
    /// elements (`(width, pitch)` for pitched reads).
    ///
    /// # Safety
    /// As for the public launches.
    #[allow(clippy::too_many_arguments, reason = "one kernel's parameters")]
    unsafe fn run(
        &self,
        stream: &Arc<CudaStream>,
        from: CastType,
        src: u64,
        to: CastType,
        dst: u64,
        n: u64,
        read: Read,
        (width, pitch): (u64, u64),
    ) -> Result<()> {
        if !can_cast(from, to) {
            return Err(unsupported(from, to));
        }
        if !dst.is_multiple_of(to.size() as u64) {
            return Err(Error::CastUnsupported {
                from: from.name().to_owned(),
                to: to.name().to_owned(),
                reason: format!("the destination 0x{dst:x} is not aligned to its elements"),
            });
        }
        if n == 0 {
            return Ok(());
        }
        // One-byte sources are read aligned whatever the address (no other entry reads
        // them unpitched).
        let read = if read == Read::Bytes && from.size() == 1 {
            Read::Aligned
        } else {
            read
        };
        let func = &self.funcs[&entry_name(from, to, read)];
        let blocks = n.div_ceil(u64::from(BLOCK)).min(u64::from(MAX_BLOCKS)) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(func);
        launch.arg(&src).arg(&dst).arg(&n).arg(&width).arg(&pitch);
        // SAFETY: the arguments are what the entry declares (two addresses, a count, a width
        // and a pitch), and the caller promises the ranges (see the public launches).
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(|e| Error::cuda("cuLaunchKernel (a cast kernel)", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bits_of(h: u16) -> u32 {
        f16_to_f32(h)
    }

    #[test]
    fn every_f16_survives_the_round_trip_through_f32() {
        for h in 0..=u16::MAX {
            let f = f16_bits_of(h);
            if (h >> 10) & 0x1f == 0x1f && h & 0x3ff != 0 {
                assert_eq!(f, 0x7fff_ffff, "{h:#x}");
                assert_eq!(f32_to_f16(f), 0x7fff);
            } else {
                assert_eq!(f32_to_f16(f), h, "{h:#x} -> {f:#x}");
                // The value itself, by an independent route for the normals.
                if (h >> 10) & 0x1f != 0 && (h >> 10) & 0x1f != 0x1f {
                    let e = i32::from((h >> 10) & 0x1f) - 15;
                    let v = (1.0 + f32::from(h & 0x3ff) / 1024.0) * 2f32.powi(e);
                    let v = if h & 0x8000 != 0 { -v } else { v };
                    assert_eq!(f32::from_bits(f), v, "{h:#x}");
                }
            }
        }
    }

    #[test]
    fn midpoints_round_to_the_even_neighbour_and_just_past_them_away() {
        // Each pair of neighbouring positive finite F16 values (and the largest to 65536).
        for h in 0u16..0x7c00 {
            let (lo, hi) = (
                f32::from_bits(f16_to_f32(h)),
                if h == 0x7bff {
                    65536.0
                } else {
                    f32::from_bits(f16_to_f32(h + 1))
                },
            );
            let mid = (lo + hi) / 2.0; // exact: F32 has 13 more bits
            let even = if h & 1 == 0 { h } else { h + 1 };
            assert_eq!(f32_to_f16(mid.to_bits()), even, "midpoint above {h:#x}");
            assert_eq!(f32_to_f16((-mid).to_bits()), 0x8000 | even);
            assert_eq!(
                f32_to_f16(mid.to_bits() + 1),
                h + 1,
                "just above the midpoint of {h:#x}"
            );
            assert_eq!(
                f32_to_f16(mid.to_bits() - 1),
                h,
                "just below the midpoint of {h:#x}"
            );
        }
        // BF16: the same on every neighbouring pair of one binade, and the specials.
        for low in 0u32..0x80 {
            let x = 0x3f80_0000 | (low << 16) | 0x8000;
            let want = (0x3f80 | low as u16) + u16::from(low & 1 == 1);
            assert_eq!(f32_to_bf16(x), want, "{x:#x}");
            assert_eq!(f32_to_bf16(x + 1), (0x3f80 | low as u16) + 1);
        }
        assert_eq!(f32_to_bf16(0x7f80_0000), 0x7f80);
        assert_eq!(f32_to_bf16(0xff80_0123), 0x7fff);
        assert_eq!(
            f32_to_bf16(0x7f7f_ffff),
            0x7f80,
            "the largest F32 rounds to infinity"
        );
        assert_eq!(f32_to_f16(0x477f_e000), 0x7bff);
        assert_eq!(f32_to_f16(0x477f_f000), 0x7c00);
        assert_eq!(f32_to_f16(0x3300_0000), 0, "2^-25 is a tie: to zero");
        assert_eq!(f32_to_f16(0x3300_0001), 1);
    }

    #[test]
    fn fp8_values_are_exact_and_their_nans_as_torch_makes_them() {
        // What torch 2.11's CUDA `.to` gave on an H200 (docs/benchmarks.md, GPU run 156).
        let e4 = |b: u8, to| reference(CastType::F8E4M3, to, &[b]).expect("cast");
        assert_eq!(e4(0x7e, CastType::BF16), 0x43e0u16.to_le_bytes());
        assert_eq!(e4(0x7e, CastType::F16), 0x5f00u16.to_le_bytes());
        assert_eq!(e4(0x01, CastType::F16), 0x1800u16.to_le_bytes());
        assert_eq!(e4(0xfd, CastType::BF16), 0xc3d0u16.to_le_bytes());
        assert_eq!(e4(0x80, CastType::BF16), 0x8000u16.to_le_bytes());
        assert_eq!(e4(0xff, CastType::BF16), 0x7fffu16.to_le_bytes());
        assert_eq!(e4(0x7f, CastType::F32), 0x7ff0_0000u32.to_le_bytes());
        assert_eq!(e4(0xff, CastType::F32), 0xfff0_0000u32.to_le_bytes());
        assert_eq!(e4(0x01, CastType::F32), 0x3b00_0000u32.to_le_bytes());
        let e5 = |b: u8, to| reference(CastType::F8E5M2, to, &[b]).expect("cast");
        assert_eq!(e5(0x7c, CastType::F16), 0x7c00u16.to_le_bytes());
        assert_eq!(e5(0xfd, CastType::F16), 0x7fffu16.to_le_bytes());
        assert_eq!(e5(0x01, CastType::BF16), 0x3780u16.to_le_bytes());
        assert_eq!(e5(0xff, CastType::F32), 0xffff_ffffu32.to_le_bytes());
        // Every finite FP8 value is exact in F16: back to F32 gives the same number.
        for b in 0..=255u8 {
            for from in [CastType::F8E4M3, CastType::F8E5M2] {
                let f = u32::from_le_bytes(
                    reference(from, CastType::F32, &[b])
                        .unwrap()
                        .try_into()
                        .unwrap(),
                );
                let h = u16::from_le_bytes(
                    reference(from, CastType::F16, &[b])
                        .unwrap()
                        .try_into()
                        .unwrap(),
                );
                if f32::from_bits(f).is_nan() {
                    assert_eq!(h, 0x7fff);
                } else {
                    assert_eq!(f16_to_f32(h), f, "{from} {b:#x}");
                }
            }
        }
    }

    #[test]
    fn pairs_outside_the_table_and_partial_elements_are_refused() {
        let err = reference(CastType::F32, CastType::F8E4M3, &[0; 4]).unwrap_err();
        assert!(
            err.to_string().contains("F8_E4M3 / F8_E5M2 to each"),
            "{err}"
        );
        let err = reference(CastType::BF16, CastType::BF16, &[0; 2]).unwrap_err();
        assert!(err.to_string().contains("copy the bytes"), "{err}");
        assert!(reference(CastType::F32, CastType::F16, &[0; 6]).is_err());
        assert_eq!(
            CastType::from_safetensors("F8_E5M2"),
            Some(CastType::F8E5M2)
        );
        assert_eq!(CastType::from_safetensors("F64"), None);
        let pairs = TYPES
            .iter()
            .flat_map(|&a| TYPES.iter().map(move |&b| (a, b)))
            .filter(|&(a, b)| can_cast(a, b))
            .count();
        assert_eq!(pairs, 12);
    }

    #[test]
    fn the_ptx_has_an_entry_per_pair_and_alignment() {
        let ptx = ptx();
        assert_eq!(ptx.matches(".visible .entry").count(), 30);
        assert!(ptx.contains(".entry cast_f32_bf16_u("));
        assert!(ptx.contains(".entry cast_e4m3_f16_p("));
        assert!(!ptx.contains(".entry cast_e4m3_f16_u("));
        // Every entry's braces close.
        assert_eq!(ptx.matches('{').count(), ptx.matches('}').count());
    }
}
