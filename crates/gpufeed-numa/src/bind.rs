//! Placing threads and memory on a node, and checking where memory really is.

use std::collections::BTreeMap;
use std::marker::PhantomData;

use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

use crate::error::{Error, Result};
use crate::topology::Topology;

/// Restores the thread's previous CPU affinity when dropped. Not `Send`: it must be dropped
/// on the thread it bound.
#[derive(Debug)]
#[must_use = "the thread's old affinity is restored when the guard drops"]
pub struct ThreadBinding {
    previous: CpuSet,
    node: u32,
    _not_send: PhantomData<*const ()>,
}

impl ThreadBinding {
    /// The node the thread is bound to.
    pub fn node(&self) -> u32 {
        self.node
    }
}

impl Drop for ThreadBinding {
    fn drop(&mut self) {
        if let Err(err) = sched_setaffinity(None, &self.previous) {
            tracing::warn!(%err, "could not restore the thread's CPU affinity");
        }
    }
}

/// How [`Topology::bind_memory`] places pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemPolicy {
    /// `MPOL_BIND` (`numactl --membind`): only this node; allocation fails rather than spill.
    Bind,
    /// `MPOL_PREFERRED` (`numactl --preferred`): this node first, others when it is full.
    Preferred,
}

const MPOL_PREFERRED: libc::c_long = 1;
const MPOL_BIND: libc::c_long = 2;
const MPOL_MF_MOVE: libc::c_ulong = 1 << 1;

impl Topology {
    /// Runs the calling thread on the CPUs of `node` only (`numactl --cpunodebind`), until the
    /// returned guard drops.
    ///
    /// # Errors
    /// [`Error::NodeOutOfRange`]; [`Error::BindRefused`] when the kernel refuses (the node's
    /// CPUs are outside this container's cpuset, say): callers can carry on unbound and record
    /// the reason.
    pub fn bind_thread(&self, node: u32) -> Result<ThreadBinding> {
        let cpus = &self.node(node)?.cpus;
        let refused = |source: std::io::Error, hint| Error::BindRefused {
            what: "bind thread",
            node,
            source,
            hint,
        };
        let previous =
            sched_getaffinity(None).map_err(|e| refused(e.into(), "sched_getaffinity failed"))?;
        let mut set = CpuSet::new();
        for &cpu in cpus.iter().filter(|&&c| (c as usize) < CpuSet::MAX_CPU) {
            set.set(cpu as usize);
        }
        sched_setaffinity(None, &set).map_err(|e| {
            refused(
                e.into(),
                "the node's CPUs are probably outside this process's cpuset (container or \
                 taskset limits); run unbound or allow those CPUs",
            )
        })?;
        Ok(ThreadBinding {
            previous,
            node,
            _not_send: PhantomData,
        })
    }

    /// Places the pages of `[ptr, ptr + len)` on `node` (`mbind` with `MPOL_MF_MOVE`: pages
    /// already touched are moved; the contents never change). The range is widened to whole
    /// pages.
    ///
    /// # Errors
    /// [`Error::NodeOutOfRange`]; [`Error::BindRefused`] (EPERM/EINVAL from the kernel, e.g. a
    /// node outside the cpuset's mems, or a range that is not mapped).
    pub fn bind_memory(
        &self,
        ptr: *const u8,
        len: usize,
        node: u32,
        policy: MemPolicy,
    ) -> Result<()> {
        self.node(node)?;
        if len == 0 {
            return Ok(());
        }
        let page = gpufeed_os::page_size();
        let start = ptr as usize / page * page;
        let end = (ptr as usize).saturating_add(len).next_multiple_of(page);
        let bits = libc::c_ulong::BITS as usize;
        let mut mask = vec![0 as libc::c_ulong; node as usize / bits + 1];
        mask[node as usize / bits] |= 1 << (node as usize % bits);
        let mode = match policy {
            MemPolicy::Bind => MPOL_BIND,
            MemPolicy::Preferred => MPOL_PREFERRED,
        };
        // SAFETY: mbind reads `mask` (live, mask.len() words, and maxnode is one past its
        // bits as the kernel expects) and changes only where pages live, never their contents.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                start,
                end - start,
                mode,
                mask.as_ptr(),
                mask.len() * bits + 1,
                MPOL_MF_MOVE,
            )
        };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOSYS) {
                return Err(Error::Unsupported {
                    what: "mbind(2)",
                    reason: "the kernel was built without NUMA support".into(),
                });
            }
            return Err(Error::BindRefused {
                what: "bind memory",
                node,
                source: err,
                hint: "the node may be outside this process's cpuset.mems, or the range is not \
                       mapped memory of this process",
            });
        }
        Ok(())
    }
}

/// Where the pages of a range are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// Pages per node.
    pub pages_per_node: BTreeMap<u32, u64>,
    /// Pages not in memory (never touched, or swapped out).
    pub not_present: u64,
    /// Pages in the range.
    pub total_pages: u64,
}

impl Placement {
    /// The node holding every present page, if exactly one does.
    pub fn single_node(&self) -> Option<u32> {
        let mut nodes = self.pages_per_node.keys();
        match (nodes.next(), nodes.next()) {
            (Some(&n), None) => Some(n),
            _ => None,
        }
    }
}

/// Where the pages of `[ptr, ptr + len)` really are (`move_pages` in query mode).
///
/// # Errors
/// [`Error::Unsupported`] on kernels without NUMA support.
pub fn placement_of(ptr: *const u8, len: usize) -> Result<Placement> {
    const BATCH: usize = 16 * 1024;
    let page = gpufeed_os::page_size();
    let start = ptr as usize / page * page;
    let end = (ptr as usize).saturating_add(len).next_multiple_of(page);
    let mut placement = Placement::default();
    let mut pages: Vec<*const libc::c_void> = Vec::with_capacity(BATCH);
    let mut status: Vec<libc::c_int> = vec![0; BATCH];
    let mut addr = start;
    while addr < end {
        pages.clear();
        while addr < end && pages.len() < BATCH {
            pages.push(addr as *const libc::c_void);
            addr += page;
        }
        // SAFETY: `pages` and `status` hold pages.len() entries; with a null `nodes` argument
        // move_pages only reports where each page is and moves nothing.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_pages,
                0,
                pages.len(),
                pages.as_ptr(),
                std::ptr::null::<libc::c_int>(),
                status.as_mut_ptr(),
                0,
            )
        };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            return Err(Error::Unsupported {
                what: "move_pages(2)",
                reason: err.to_string(),
            });
        }
        for &s in &status[..pages.len()] {
            placement.total_pages += 1;
            match u32::try_from(s) {
                Ok(node) => *placement.pages_per_node.entry(node).or_default() += 1,
                Err(_) => placement.not_present += 1,
            }
        }
    }
    Ok(placement)
}
