//! Checkpoint tensors written into device memory Python owns (`gpufeed.load_into`): the
//! destinations checked against the headers (dtype, shape, bytes, no two overlapping) before a
//! byte moves, then `gpufeed_safetensors::LoadInto` with each piece copied to its tensor by
//! address.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use pyo3::prelude::*;

use crate::GpufeedError;
use crate::errors::py_err;
use crate::loads::{kept, shared_loader};
use crate::safe_open::dtype_name;
use gpufeed::cuda::cast::{CastKernel, CastType, can_cast};

/// The cast kernels, compiled once per device.
fn cast_kernels() -> &'static parking_lot::Mutex<HashMap<usize, std::sync::Arc<CastKernel>>> {
    static KERNELS: std::sync::OnceLock<
        parking_lot::Mutex<HashMap<usize, std::sync::Arc<CastKernel>>>,
    > = std::sync::OnceLock::new();
    KERNELS.get_or_init(Default::default)
}

/// What `load_into` reports: `(missing, unexpected, bytes, seconds, staging_bytes)`.
type Written = (Vec<String>, Vec<String>, u64, f64, u64);

/// The most problems one error lists.
const LISTED: usize = 8;

/// Writes the tensors of the checkpoint `path` named `names` into the device memory at `ptrs`
/// (each `nbytes` long, holding `dtypes`/`shapes` as safetensors names them) on GPU `device`.
/// Every destination is checked first: a name the checkpoint lacks is missing, a checkpoint
/// tensor not named is unexpected (both an error under `strict`), a dtype, shape or size that
/// differs is an error, and so are two destinations that overlap (the same memory twice is
/// allowed: the tensor read later wins, files in the index's order, tensors in a file's). The caller (`gpufeed.load_into`) takes the
/// pointers from contiguous CUDA tensors of `device` that it holds for the call. `plan`, where
/// given, holds per name `None` (the whole tensor) or a dimension and a slice of it as `(dim,
/// (start, stop, step))` (Python's slice fields): the destination then holds that part only
/// (as `torch.narrow` gives it, contiguous). Along the first dimension only the part's bytes
/// are read; along another the span from its first run to its last (`LoadInto::narrow`).
/// A destination of another floating type than the checkpoint's is cast into on the way where
/// `gpufeed_cuda::cast` does the pair.
#[pyfunction]
#[pyo3(signature = (path, device, names, ptrs, nbytes, dtypes, shapes, strict=true, staging_bytes=None, plan=None))]
#[allow(
    clippy::too_many_arguments,
    reason = "one list per field of the destinations"
)]
pub(crate) fn load_into(
    py: Python<'_>,
    path: PathBuf,
    device: usize,
    names: Vec<String>,
    ptrs: Vec<u64>,
    nbytes: Vec<usize>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<usize>>,
    strict: bool,
    staging_bytes: Option<usize>,
    plan: Option<Vec<Option<(usize, RowSlice)>>>,
) -> PyResult<Written> {
    let n = names.len();
    let plan = plan.unwrap_or_else(|| vec![None; n]);
    if [
        ptrs.len(),
        nbytes.len(),
        dtypes.len(),
        shapes.len(),
        plan.len(),
    ] != [n; 5]
    {
        return Err(GpufeedError::new_err(
            "load_into: names, ptrs, nbytes, dtypes, shapes and plan differ in length",
        ));
    }
    let ckpt = py
        .detach(|| gpufeed::safetensors::LoadInto::open(&path))
        .map_err(py_err)?;
    let (mut missing, mut wrong) = (Vec::new(), Vec::new());
    // Per name written with a cast: its checkpoint type and the destination's.
    let mut casts: HashMap<&str, (CastType, CastType)> = HashMap::new();
    let mut uncastable = false;
    // Per name planned along a dimension other than the first: which bytes read are its.
    let mut shares: HashMap<&str, gpufeed::safetensors::Share> = HashMap::new();
    let mut present: Vec<usize> = Vec::with_capacity(n);
    // Per name: the bytes of the tensor its destination takes.
    let mut parts: Vec<std::ops::Range<usize>> = vec![0..0; n];
    for i in 0..n {
        let Some(t) = ckpt.get(&names[i]) else {
            missing.push(names[i].clone());
            continue;
        };
        let dtype = dtype_name(t.dtype);
        let mut shape = t.shape.clone();
        let mut bytes = t.range.end - t.range.start;
        parts[i] = match plan[i] {
            None => 0..bytes,
            Some((dim, slice)) => {
                let range = span_of(&names[i], &t.shape, dim, slice)?;
                let (read, share) = ckpt.narrow(&names[i], dim, range.clone()).map_err(py_err)?;
                shape[dim] = range.end - range.start;
                bytes = share.bytes();
                if share.runs() > 1 {
                    shares.insert(names[i].as_str(), share);
                }
                read
            }
        };
        if dtype != dtypes[i] {
            // A cast on the way where the kernels do it: the destination holds as many
            // elements of its own type.
            let pair =
                CastType::from_safetensors(&dtype).zip(CastType::from_safetensors(&dtypes[i]));
            if let Some((from, to)) = pair.filter(|&(from, to)| can_cast(from, to)) {
                if !ptrs[i].is_multiple_of(to.size() as u64) {
                    return Err(GpufeedError::new_err(format!(
                        "{}: the destination at 0x{:x} is not aligned to its {} elements \
                         (nothing was written)",
                        names[i], ptrs[i], dtypes[i]
                    )));
                }
                casts.insert(names[i].as_str(), (from, to));
                bytes = bytes / from.size() * to.size();
            } else {
                uncastable = true;
            }
        }
        if (dtype != dtypes[i] && !casts.contains_key(names[i].as_str()))
            || shape != shapes[i]
            || bytes != nbytes[i]
        {
            let what = if plan[i].is_some() {
                "its planned part: "
            } else {
                ""
            };
            wrong.push(format!(
                "{}: the checkpoint has {what}{dtype} {shape:?} ({bytes} bytes), the destination {} {:?} ({} bytes)",
                names[i], dtypes[i], shapes[i], nbytes[i]
            ));
        }
        present.push(i);
    }
    if !wrong.is_empty() {
        let casting = if uncastable {
            "; casts on the way: BF16, F16 and F32 to one another, F8_E4M3 and F8_E5M2 to \
             each of those"
        } else {
            ""
        };
        return Err(GpufeedError::new_err(format!(
            "{}: {} tensor(s) do not match their destinations (nothing was written; allocate \
             them as the checkpoint has them, or cast or reshape after loading{casting}): {}",
            path.display(),
            wrong.len(),
            listed(&wrong)
        )));
    }
    let named: HashSet<&str> = names.iter().map(String::as_str).collect();
    let unexpected: Vec<String> = ckpt
        .tensors()
        .filter(|t| !named.contains(t.name.as_str()))
        .map(|t| t.name.clone())
        .collect();
    if strict && (!missing.is_empty() || !unexpected.is_empty()) {
        return Err(GpufeedError::new_err(format!(
            "{}: nothing was written (strict): missing key(s) in the checkpoint: {}; unexpected \
             key(s) in the checkpoint: {} (strict=False loads the tensors both have)",
            path.display(),
            listed(&missing),
            listed(&unexpected)
        )));
    }
    overlaps(&present, &names, &ptrs, &nbytes)?;
    let to: HashMap<&str, u64> = present
        .iter()
        .map(|&i| (names[i].as_str(), ptrs[i]))
        .collect();
    let asked: Vec<(&str, std::ops::Range<usize>)> = present
        .iter()
        .map(|&i| (names[i].as_str(), parts[i].clone()))
        .collect();
    let loader = shared_loader(py, device)?;
    let kernel = if casts.is_empty() {
        None
    } else {
        let gpu = loader.gpu().clone();
        Some(kept(py, cast_kernels(), device, move || {
            Ok(CastKernel::load(&gpu)?)
        })?)
    };
    let mut opts = gpufeed::safetensors::LoadIntoOptions::default();
    if let Some(bytes) = staging_bytes {
        opts = opts.with_staging_bytes(bytes);
    }
    let _context = gpufeed::cuda::ContextGuard::new();
    let report = py
        .detach(|| {
            ckpt.run_ranges(&loader, &asked, &opts, |piece| {
                let Some(&dst) = to.get(piece.name) else {
                    return Err(gpufeed::safetensors::Error::invalid(format!(
                        "a piece of {} that was not asked for",
                        piece.name
                    )));
                };
                let len = piece.bytes.len();
                if let Some(share) = shares.get(piece.name) {
                    let cast = casts.get(piece.name).zip(kernel.as_ref());
                    #[allow(unsafe_code, reason = "copies into a checked device range")]
                    // SAFETY: `dst` is the destination checked above (the part's elements in
                    // its own type, overlapping no other, aligned as a tensor of that type),
                    // held by the caller for the call.
                    return unsafe {
                        match cast {
                            Some((&(from, to), kernel)) => {
                                share.cast_piece(&piece, dst, kernel, from, to)
                            }
                            None => share.copy_piece(&piece, dst),
                        }
                    };
                }
                if let (Some(&(from, to)), Some(kernel)) = (casts.get(piece.name), &kernel) {
                    let n = len / from.size();
                    #[allow(unsafe_code, reason = "a cast between two checked device ranges")]
                    // SAFETY: as for the copy below, the destination's elements `offset /
                    // from.size()` on being as many elements of `to` as the piece holds of
                    // `from` (the destination was checked to hold the tensor's elements in its
                    // own type; pieces are whole elements).
                    return unsafe {
                        kernel.launch_raw(
                            piece.stream,
                            from,
                            piece.address,
                            to,
                            dst + (piece.offset / from.size() * to.size()) as u64,
                            n as u64,
                        )
                    }
                    .map_err(gpufeed::safetensors::Error::from);
                }
                #[allow(unsafe_code, reason = "copies between two checked device ranges")]
                // SAFETY: `dst..dst + nbytes` is device memory of this GPU that the caller holds
                // for the call (a CUDA tensor of `device`), checked to be the size of the tensor
                // or of its planned part and to overlap no other destination; `offset + len` is
                // within that; the source is the staging piece `LoadInto` keeps until the
                // stream's copies end.
                unsafe {
                    gpufeed::cuda::copy::dtod_async(
                        piece.stream,
                        dst + piece.offset as u64,
                        piece.address,
                        len,
                    )
                }
                .map_err(gpufeed::safetensors::Error::from)
            })
        })
        .map_err(py_err)?;
    Ok((
        missing,
        unexpected,
        report.bytes,
        report.seconds,
        report.staging_bytes,
    ))
}

/// A slice of rows as Python's slice has it: `(start, stop, step)`, each `None` or an int.
type RowSlice = (Option<i64>, Option<i64>, Option<i64>);

/// The indices a `plan` slice takes of dimension `dim` of a tensor of `shape` named `name`,
/// checked as `prefetch`'s plans are: bounds within `-n..=n`, step 1, a dimension the tensor
/// has.
fn span_of(
    name: &str,
    shape: &[usize],
    dim: usize,
    (start, stop, step): RowSlice,
) -> PyResult<std::ops::Range<usize>> {
    let bad = |why: String| GpufeedError::new_err(format!("load_into plan for {name}: {why}"));
    let Some(&n) = shape.get(dim) else {
        return Err(bad(if shape.is_empty() {
            "a 0-d tensor has no rows to slice".into()
        } else {
            format!("no dimension {dim} in a tensor of shape {shape:?}")
        }));
    };
    if let Some(step) = step.filter(|&s| s != 1) {
        return Err(bad(format!("slices must have step 1, got {step}")));
    }
    let n = n as i64;
    let what = if dim == 0 {
        "rows".to_owned()
    } else {
        format!("indices of dimension {dim}")
    };
    let resolve = |v: Option<i64>, default: i64, bound: &str| -> PyResult<i64> {
        match v {
            None => Ok(default),
            Some(v) if v > n || v < -n => Err(bad(format!(
                "slice {bound} {v} is out of range for {n} {what}"
            ))),
            Some(v) if v < 0 => Ok(v + n),
            Some(v) => Ok(v),
        }
    };
    let a = resolve(start, 0, "start")?;
    let b = resolve(stop, n, "stop")?.max(a);
    Ok(a as usize..b as usize)
}

/// At most [`LISTED`] of `items`, joined, with how many more there are.
fn listed(items: &[String]) -> String {
    if items.is_empty() {
        return "none".to_owned();
    }
    let mut s = items[..items.len().min(LISTED)].join("; ");
    if items.len() > LISTED {
        s.push_str(&format!("; and {} more", items.len() - LISTED));
    }
    s
}

/// Refuses destinations `present` (indices) that overlap, except the same memory twice.
fn overlaps(present: &[usize], names: &[String], ptrs: &[u64], nbytes: &[usize]) -> PyResult<()> {
    let mut by_address: Vec<usize> = present.iter().copied().filter(|&i| nbytes[i] > 0).collect();
    by_address.sort_by_key(|&i| (ptrs[i], nbytes[i]));
    for pair in by_address.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let same = ptrs[a] == ptrs[b] && nbytes[a] == nbytes[b];
        if !same && ptrs[a] + nbytes[a] as u64 > ptrs[b] {
            return Err(GpufeedError::new_err(format!(
                "the destinations of {} and {} overlap (nothing was written): give each tensor \
                 memory of its own",
                names[a], names[b]
            )));
        }
    }
    Ok(())
}
