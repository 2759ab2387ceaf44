//! Whether the CUDA driver can be used at all. cudarc panics on its first call when libcuda is
//! missing, so every entry point asks here first.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// `Ok` when libcuda can be loaded; [`Error::NoCudaDriver`] otherwise. Cached after the first
/// call. Never panics.
pub fn driver_available() -> Result<()> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the library by its known names.
    let present = *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() });
    if present {
        Ok(())
    } else {
        Err(Error::NoCudaDriver)
    }
}
