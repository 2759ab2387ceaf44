//! What the Python iterators of `BatchLoader` and `ImageLoader` epochs share: the loader waits
//! in its slot between epochs; a running epoch owns it and puts it back at its end or when
//! dropped; positions go to and come from Python as JSON-ready dicts.

use std::sync::Arc;

use gpufeed::dataset::Position;
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::GpufeedError;
use crate::errors::py_err;
use crate::machine::from_json;

/// Where a loader waits between epochs.
pub(crate) type Slot<L> = Arc<Mutex<Option<L>>>;

/// An epoch that owns its loader (`gpufeed_data`'s `OwnedEpoch`, `OwnedImageEpoch`).
pub(crate) trait OwnedRun: Iterator + Send {
    type Loader: Send;
    /// Where the run is after the items yielded (an elastic sampler's; not `position`, which
    /// is `Iterator`'s).
    fn at(&self) -> Option<Position>;
    /// The loader back (the epoch's threads stop first).
    fn into_loader(self) -> Self::Loader;
}

impl OwnedRun for gpufeed::dataset::OwnedEpoch {
    type Loader = gpufeed::dataset::BatchLoader;
    fn at(&self) -> Option<Position> {
        gpufeed::dataset::OwnedEpoch::position(self)
    }
    fn into_loader(self) -> Self::Loader {
        gpufeed::dataset::OwnedEpoch::into_loader(self)
    }
}

impl OwnedRun for gpufeed::dataset::OwnedImageEpoch {
    type Loader = gpufeed::dataset::ImageLoader;
    fn at(&self) -> Option<Position> {
        gpufeed::dataset::OwnedImageEpoch::position(self)
    }
    fn into_loader(self) -> Self::Loader {
        gpufeed::dataset::OwnedImageEpoch::into_loader(self)
    }
}

/// An epoch running, or ended with its last position (the loader back in its slot).
enum State<E> {
    Running(Box<E>),
    Ended(Option<Position>),
}

/// A Python iterator's epoch: its state and the slot its loader goes back to.
pub(crate) struct Epoch<E: OwnedRun> {
    state: Mutex<State<E>>,
    slot: Slot<E::Loader>,
}

impl<E: OwnedRun> Epoch<E> {
    /// Takes the loader out of `slot` and starts an epoch with `start`, which gives the loader
    /// back with its error where it starts none (then the loader goes back to the slot).
    pub(crate) fn start(
        py: Python<'_>,
        slot: &Slot<E::Loader>,
        start: impl FnOnce(E::Loader) -> Result<E, Box<(gpufeed::dataset::Error, E::Loader)>> + Send,
    ) -> PyResult<Self> {
        let _context = gpufeed::cuda::ContextGuard::new();
        let loader = slot.lock().take().ok_or_else(|| {
            GpufeedError::new_err(
                "an epoch is already running: iterate it to the end (or drop it) first",
            )
        })?;
        match py.detach(|| start(loader)) {
            Ok(running) => Ok(Epoch {
                state: Mutex::new(State::Running(Box::new(running))),
                slot: Arc::clone(slot),
            }),
            Err(not) => {
                let (error, loader) = *not;
                *slot.lock() = Some(loader);
                Err(py_err(error))
            }
        }
    }

    /// The epoch's next item, without the GIL; at the epoch's end the loader goes back.
    pub(crate) fn next(&self, py: Python<'_>) -> Option<E::Item>
    where
        E::Item: Send,
    {
        py.detach(|| {
            let mut state = self.state.lock();
            let State::Running(epoch) = &mut *state else {
                return None;
            };
            let next = epoch.next();
            if next.is_none() {
                end(&mut state, &self.slot);
            }
            next
        })
    }

    /// Where the run is after the items handed out so far, as a dict; `loader` names the class
    /// in the error of a loader that is not elastic.
    pub(crate) fn position<'py>(
        &self,
        py: Python<'py>,
        loader: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        // A `__next__` of another thread may hold the epoch while it waits for a batch.
        let at = py
            .detach(|| match &*self.state.lock() {
                State::Running(e) => e.at(),
                State::Ended(at) => *at,
            })
            .ok_or_else(|| {
                GpufeedError::new_err(format!(
                    "invalid setting: positions are for elastic loaders: {loader}(..., \
                     global_batch=N)"
                ))
            })?;
        let value = serde_json::to_value(at).map_err(|e| GpufeedError::new_err(e.to_string()))?;
        from_json(py, &value)
    }

    /// Ends the epoch where it runs (its threads finish what they hold, without the GIL
    /// meanwhile); for the iterator's `Drop`.
    pub(crate) fn end(&mut self) {
        let (state, slot) = (&mut self.state, &self.slot);
        Python::attach(|py| py.detach(|| end(state.get_mut(), slot)));
    }
}

/// Ends the epoch in `state`, if it runs: the loader goes back to `slot`.
fn end<E: OwnedRun>(state: &mut State<E>, slot: &Slot<E::Loader>) {
    let position = match state {
        State::Running(e) => e.at(),
        State::Ended(_) => return,
    };
    if let State::Running(e) = std::mem::replace(state, State::Ended(position)) {
        *slot.lock() = Some(e.into_loader());
    }
}

/// `position` (a dict from an epoch's `position()`) as a [`Position`].
pub(crate) fn position_from(py: Python<'_>, position: Bound<'_, PyAny>) -> PyResult<Position> {
    let text: String = py
        .import("json")?
        .call_method1("dumps", (position,))?
        .extract()?;
    serde_json::from_str(&text).map_err(|e| {
        GpufeedError::new_err(format!(
            "invalid setting: not a position (a dict from an epoch's position()): {e}"
        ))
    })
}
