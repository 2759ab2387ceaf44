//! Libraries loaded at run time (NCCL, nvJPEG): the first of a list of names that loads and
//! resolves, else what was tried and why each failed.

/// The library names to try: the one a variable gives (`var`: its value, where set and not
/// empty), else `defaults` in order.
pub(crate) fn candidates(var: Option<std::ffi::OsString>, defaults: &[&str]) -> Vec<String> {
    match var {
        Some(v) if !v.is_empty() => vec![v.to_string_lossy().into_owned()],
        _ => defaults.iter().map(|&n| n.to_owned()).collect(),
    }
}

/// Opens the first of `names` that loads and that `resolve` accepts (its entry points found,
/// its version checked); else each name tried and why it failed, joined by `"; "`.
///
/// # Safety
/// Loading a library runs its initialisers: every name must be the library the caller means
/// (whose initialisers only set up its own state), or a path the user gave for it.
pub(crate) unsafe fn open_first<T>(
    names: &[String],
    resolve: impl Fn(libloading::Library, &str) -> Result<T, String>,
) -> Result<T, String> {
    let mut why = Vec::new();
    for name in names {
        // SAFETY: the caller's promise (see above).
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => match resolve(lib, name) {
                Ok(t) => return Ok(t),
                Err(e) => why.push(format!("{name}: {e}")),
            },
            Err(e) => why.push(format!("{name}: {e}")),
        }
    }
    Err(why.join("; "))
}
