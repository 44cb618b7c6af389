//! Placeholders in processes that do not own their connection: a forked child (its copy of the
//! owner's tables), a program started by `exec` (it finds the placeholders among its fds when
//! the library loads), a process that received one by `SCM_RIGHTS`. Such a process takes the
//! connection over on its first call on the fd: it proves to the owner, over the owner's
//! attach socket, that it holds the placeholder, and puts the kernel TCP socket it gets back
//! (the program's end of a relayed connection) under the same fd number. From then on the fd is
//! plain kernel TCP to this process, with kernel TCP's semantics, relayed by the owner.
//!
//! A child that never uses an inherited socket costs nothing. When the owner is gone (it
//! exited, or it is this very process after `exec`: its engine did not survive the exec), the
//! connection is gone too, and the fd becomes a socket that reports a reset, as a TCP socket
//! whose connection was reset does.

use std::ffi::c_int;
use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::carried::{self, Carried};
use crate::connect::{cloexec, nonblocking};
use crate::interpose::dup_onto;
use crate::process::{inside, pid};
use crate::table;

/// A placeholder whose connection belongs to another process.
pub(crate) struct Remote {
    pub owner: u32,
    pub id: u64,
}

/// The abstract socket name of a placeholder: "nc/<owner pid>/<connection id>".
pub(crate) fn placeholder_name(owner: u32, id: u64) -> String {
    format!("nc/{owner}/{id}")
}

/// Reads a placeholder's name: `(owner pid, connection id)`.
pub(crate) fn recognize(fd: BorrowedFd<'_>) -> Option<(u32, u64)> {
    let addr = rustix::net::getsockname(fd).ok()?;
    let unix = SocketAddrUnix::try_from(addr).ok()?;
    let name = unix.abstract_name()?;
    let name = std::str::from_utf8(name).ok()?;
    let mut parts = name.strip_prefix("nc/")?.split('/');
    let owner = parts.next()?.parse().ok()?;
    let id = parts.next()?.parse().ok()?;
    parts.next().is_none().then_some((owner, id))
}

/// A placeholder found in this process (at load time, or received by `SCM_RIGHTS`): noted
/// under its number. One of this process's own connections becomes direct again.
pub(crate) fn adopt(fd: c_int, app: BorrowedFd<'_>) {
    if !table::in_range(fd) {
        return;
    }
    let Some((owner, id)) = recognize(app) else { return };
    if owner == pid() {
        match carried::registered(id) {
            Some(c) if c.is_placeholder(app) => table::map_carried(fd, c),
            // Ours, but from before an exec of this very process: its engine is gone.
            _ => {
                let _ = make_dead(fd, app);
            }
        }
        return;
    }
    table::map_remote(fd, Arc::new(Remote { owner, id }));
}

/// Scans the fds this process started with for placeholders (a program run by `exec` from a
/// process whose connections are carried).
pub(crate) fn scan_inherited() {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return };
    let fds: Vec<c_int> = dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect();
    for fd in fds {
        crate::interpose::with_fd(fd, |app| {
            let is_socket = rustix::fs::fstat(app)
                .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_socket());
            if is_socket {
                adopt(fd, app);
            }
        });
    }
}

/// Takes over the connection under `fd`, which this process holds but does not own (its first
/// call on it): afterwards `fd` is a kernel TCP socket and the caller makes the real call.
pub(crate) fn take_over(fd: c_int, app: BorrowedFd<'_>) {
    let (owner, id, local): (u32, u64, Option<Arc<Carried>>) = if let Some(c) = table::carried(fd) {
        (c.owner, c.id, Some(c))
    } else if let Some(r) = table::remote(fd) {
        (r.owner, r.id, None)
    } else {
        return;
    };
    // Every number of this process holding the same placeholder moves with it.
    let mut fds = match &local {
        Some(c) => table::fds_of(c),
        None => {
            let map = table::TABLES.remote.lock();
            map.iter().filter(|(_, r)| r.owner == owner && r.id == id).map(|(fd, _)| *fd).collect()
        }
    };
    if !fds.contains(&fd) {
        fds.push(fd);
    }
    let nb = nonblocking(app);
    match inside(|| request(owner, id, app)) {
        Ok(sock) => {
            if nb {
                let _ = rustix::fs::fcntl_setfl(&sock, rustix::fs::OFlags::NONBLOCK);
            }
            if let Some(c) = &local {
                for ((level, name), value) in c.opts.all() {
                    let _ = crate::interpose::raw_setsockopt(sock.as_fd(), level, name, &value);
                }
            }
            for n in &fds {
                let cx = crate::interpose::with_fd(*n, cloexec);
                let _ = dup_onto(sock.as_fd(), *n, cx);
            }
        }
        Err(_) => {
            for n in &fds {
                crate::interpose::with_fd(*n, |b| {
                    let _ = make_dead(*n, b);
                });
            }
        }
    }
    for n in fds {
        // A child's copy of the owner's connection is dropped without closing the virtual
        // socket (`Carried`'s drop leaves that to the owner).
        table::unmap_carried(n);
        table::unmap_remote(n);
    }
}

/// Asks the owner for the connection: sends the id and a copy of the placeholder, gets back the
/// program's end of a relayed TCP connection.
fn request(owner: u32, id: u64, placeholder: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let s = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let name = crate::relay::attach_name(owner);
    rustix::net::connect(&s, &SocketAddrUnix::new_abstract_name(name.as_bytes())?)?;
    rustix::net::sockopt::set_socket_timeout(
        &s,
        rustix::net::sockopt::Timeout::Recv,
        Some(std::time::Duration::from_secs(5)),
    )?;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let proof = [placeholder];
    control.push(SendAncillaryMessage::ScmRights(&proof));
    rustix::net::sendmsg(
        &s,
        &[IoSlice::new(&id.to_ne_bytes())],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    let mut status = [0u8; 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    rustix::net::recvmsg(
        &s,
        &mut [IoSliceMut::new(&mut status)],
        &mut control,
        RecvFlags::CMSG_CLOEXEC,
    )?;
    let mut got = None;
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = msg {
            for fd in fds {
                got.get_or_insert(fd);
            }
        }
    }
    match (status[0], got) {
        (1, Some(fd)) => {
            // Not before the owner has closed its copy (`relay::ATTACH_RELEASED`): ours must be
            // the only one, so that the relay sees our close as the kernel does. Whatever the
            // answer (the owner gone, the timeout), the end is ours.
            let mut released = [0u8; 1];
            let _ = rustix::net::recv(&s, &mut released, RecvFlags::empty());
            Ok(fd)
        }
        _ => Err(io::Error::new(io::ErrorKind::ConnectionReset, "the connection is gone")),
    }
}

/// Puts under `fd` a socket that reports a reset connection (`ECONNRESET`, then end of stream,
/// `EPIPE` on writes; `POLLERR|POLLHUP`), as a TCP socket whose connection was reset.
fn make_dead(fd: c_int, app: BorrowedFd<'_>) -> io::Result<()> {
    let (a, b) = rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::STREAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::send(&a, &[0], SendFlags::DONTWAIT)?;
    drop(b);
    let cx = cloexec(app);
    dup_onto(a.as_fd(), fd, cx).map_err(io::Error::from_raw_os_error)?;
    table::unmap_remote(fd);
    Ok(())
}
