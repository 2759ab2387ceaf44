//! The thread-pool engine: N workers doing `pread`.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::engine::{Engine, RawRead, RawResult};

struct Queue {
    jobs: Mutex<(VecDeque<RawRead>, bool)>,
    ready: Condvar,
}

pub(crate) struct ThreadEngine {
    queue: Arc<Queue>,
    done: Receiver<RawResult>,
    workers: Vec<JoinHandle<()>>,
    capacity: usize,
    in_flight: usize,
}

impl ThreadEngine {
    pub(crate) fn new(threads: usize, capacity: usize) -> io::Result<Self> {
        let queue = Arc::new(Queue {
            jobs: Mutex::new((VecDeque::new(), false)),
            ready: Condvar::new(),
        });
        let (tx, done) = channel();
        let mut workers = Vec::new();
        for i in 0..threads.max(1) {
            let (queue, tx) = (Arc::clone(&queue), tx.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("gpufeed-read-{i}"))
                    .spawn(move || worker(&queue, &tx))?,
            );
        }
        Ok(ThreadEngine {
            queue,
            done,
            workers,
            capacity: capacity.max(1),
            in_flight: 0,
        })
    }
}

fn worker(queue: &Queue, tx: &Sender<RawResult>) {
    loop {
        let job = {
            let mut jobs = queue.jobs.lock();
            loop {
                if let Some(job) = jobs.0.pop_front() {
                    break job;
                }
                if jobs.1 {
                    return;
                }
                queue.ready.wait(&mut jobs);
            }
        };
        // SAFETY: the reader keeps the fd open and the buffer exclusively ours until this
        // job's completion is received (Engine::push's contract).
        let result = unsafe {
            let fd = BorrowedFd::borrow_raw(job.fd);
            let buf = std::slice::from_raw_parts_mut(job.ptr, job.len as usize);
            rustix::io::pread(fd, buf, job.offset).map_err(io::Error::from)
        };
        if tx.send((job.tag, result)).is_err() {
            return;
        }
    }
}

impl Engine for ThreadEngine {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn push(&mut self, read: RawRead) -> io::Result<()> {
        self.queue.jobs.lock().0.push_back(read);
        self.queue.ready.notify_one();
        self.in_flight += 1;
        Ok(())
    }

    fn wait(&mut self, min: usize, out: &mut Vec<RawResult>) -> io::Result<()> {
        let mut got = 0;
        while got < min {
            let c = self
                .done
                .recv()
                .map_err(|_| io::Error::other("every read worker thread has exited"))?;
            out.push(c);
            got += 1;
        }
        while let Ok(c) = self.done.try_recv() {
            out.push(c);
            got += 1;
        }
        self.in_flight -= got;
        Ok(())
    }

    fn prefetch(&mut self, fd: RawFd, offset: u64, len: u64) -> io::Result<()> {
        // SAFETY: the caller holds fd open for the call.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        gpufeed_os::advise::readahead(fd, offset, len).map_err(|e| io::Error::other(e.to_string()))
    }
}

impl Drop for ThreadEngine {
    fn drop(&mut self) {
        // The reader drains every read before dropping the engine; stop the workers.
        self.queue.jobs.lock().1 = true;
        self.queue.ready.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
