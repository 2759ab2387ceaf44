//! Passing a file descriptor (a ring's memfd) to another process over a Unix socket.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

use crate::error::{Error, Result};

/// Sends `fd` over the connected Unix socket `socket` (`SCM_RIGHTS`).
pub fn send_fd(socket: impl AsFd, fd: BorrowedFd<'_>) -> Result<()> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(Error::Io {
            op: "build SCM_RIGHTS message",
            source: std::io::Error::other("control buffer too small"),
        });
    }
    rustix::net::sendmsg(
        socket,
        &[std::io::IoSlice::new(b"F")],
        &mut control,
        SendFlags::empty(),
    )
    .map_err(|e| Error::Io {
        op: "sendmsg(SCM_RIGHTS)",
        source: e.into(),
    })?;
    Ok(())
}

/// Receives one file descriptor sent with [`send_fd`].
pub fn recv_fd(socket: impl AsFd) -> Result<OwnedFd> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    rustix::net::recvmsg(
        socket,
        &mut [std::io::IoSliceMut::new(&mut byte)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| Error::Io {
        op: "recvmsg(SCM_RIGHTS)",
        source: e.into(),
    })?;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(mut fds) = msg
            && let Some(fd) = fds.next()
        {
            return Ok(fd);
        }
    }
    Err(Error::Io {
        op: "recvmsg(SCM_RIGHTS)",
        source: std::io::Error::other("the message carried no file descriptor"),
    })
}
