//! The machine: `doctor` (its checks) and `advise` (where data should live and how it should
//! reach the GPU), as Python objects.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::GpufeedError;
use crate::errors::py_err;

/// A JSON text as Python objects.
pub(crate) fn from_json<'py>(
    py: Python<'py>,
    value: &serde_json::Value,
) -> PyResult<Bound<'py, PyAny>> {
    py.import("json")?
        .call_method1("loads", (value.to_string(),))
}

/// The machine's checks (`gpufeed doctor`): a list of dicts `{name, status, observed, fix}`.
#[pyfunction]
#[pyo3(signature = (path=None))]
pub(crate) fn doctor(py: Python<'_>, path: Option<PathBuf>) -> PyResult<Bound<'_, PyAny>> {
    let _context = gpufeed::cuda::ContextGuard::new();
    let checks = py.detach(|| gpufeed::doctor::run(path.as_deref()));
    let value = serde_json::to_value(&checks).map_err(|e| GpufeedError::new_err(e.to_string()))?;
    from_json(py, &value)
}

/// Where data should live and how it should reach the GPU (`gpufeed advise`), as a dict
/// `{workload, recommendation, trials}`; `measure=True` runs short trials on `path`.
#[pyfunction]
#[pyo3(signature = (size=None, path=None, persistent=false, processes=1, measure=false))]
pub(crate) fn advise(
    py: Python<'_>,
    size: Option<u64>,
    path: Option<PathBuf>,
    persistent: bool,
    processes: usize,
    measure: bool,
) -> PyResult<Bound<'_, PyAny>> {
    let _context = gpufeed::cuda::ContextGuard::new();
    let result = py.detach(|| -> gpufeed::Result<serde_json::Value> {
        let workload = match (size, &path) {
            (Some(size_bytes), _) => gpufeed::advise::Workload {
                persistent,
                processes: processes.max(1),
                size_bytes,
                resident: None,
            },
            (None, Some(p)) => gpufeed::advise::Workload::of_file(p, persistent, processes)?,
            (None, None) => {
                return Err(gpufeed::Error::invalid(
                    "say how large the data is: size=4 << 30 or path=FILE".into(),
                ));
            }
        };
        let rec = gpufeed::advise::advise(&workload);
        let trials = match (measure, &path) {
            (true, Some(p)) => Some(gpufeed::advise::measure(p, 1 << 30)?),
            (true, None) => {
                return Err(gpufeed::Error::invalid(
                    "measure=True runs trials on a file: give it with path=FILE".into(),
                ));
            }
            (false, _) => None,
        };
        Ok(serde_json::json!({ "workload": workload, "recommendation": rec, "trials": trials }))
    });
    from_json(py, &result.map_err(py_err)?)
}
