//! gpufeed's errors as the Python exceptions (`GpufeedError`, `NoGpuError`) with their message.

use pyo3::prelude::*;

use crate::{GpufeedError, NoGpuError};

/// A gpufeed error as the Python exception with the same message.
pub(crate) fn py_err(e: impl Into<gpufeed::Error>) -> PyErr {
    let e: gpufeed::Error = e.into();
    if e.is_no_gpu() {
        NoGpuError::new_err(e.to_string())
    } else {
        GpufeedError::new_err(e.to_string())
    }
}
