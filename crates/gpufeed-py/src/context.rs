//! What a Python object that may bind a GPU's context to the thread dropping it puts back.

/// A Python object's last field: its `Drop` stores a [`gpufeed::cuda::ContextGuard`] here
/// before the other fields go (they may bind their GPU's context to the dropping thread:
/// streams, staging, device memory), and the guard, dropped after them, puts back the context
/// that was current (torch's device).
#[derive(Default)]
pub(crate) struct KeepContext(Option<gpufeed::cuda::ContextGuard>);

impl KeepContext {
    pub(crate) fn arm(&mut self) {
        self.0 = Some(gpufeed::cuda::ContextGuard::new());
    }
}
