//! The channel listener: accepts TCP connections and runs their handshakes without blocking,
//! many at once on one thread, each with a deadline. At most `max_handshakes` are in progress;
//! beyond that a connection is refused at once. Nothing per peer exists until a handshake is
//! confirmed (with a pre-shared key: until the dialer proved it holds the key).

use std::collections::HashMap;
use std::io;
use std::net::TcpListener;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::EngineCtx;
use crate::driver::tcp::{Incoming, Progress};
use crate::sys::{Epoll, EventFd, READABLE};
use crate::wire::{Handshake, RejectReason};

const TOKEN_LISTENER: u64 = 0;
const TOKEN_STOP: u64 = 1;

pub(crate) fn run(ctx: Arc<EngineCtx>, listener: TcpListener, stop: Arc<EventFd>) {
    if let Err(e) = serve(&ctx, &listener, &stop) {
        eprintln!("netchannel: channel listener stopped: {e}");
    }
}

fn serve(ctx: &Arc<EngineCtx>, listener: &TcpListener, stop: &EventFd) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let epoll = Epoll::new()?;
    epoll.add(listener.as_fd(), READABLE, TOKEN_LISTENER)?;
    epoll.add(stop.as_fd(), READABLE, TOKEN_STOP)?;
    let mut pending: HashMap<u64, Incoming> = HashMap::new();
    let mut next_token = 2u64;
    let mut events = Vec::new();
    let key = ctx.config.psk.clone();
    loop {
        let timeout = pending
            .values()
            .map(|p| p.deadline)
            .min()
            .map(|d| d.saturating_duration_since(Instant::now()));
        events.clear();
        epoll.wait(&mut events, 64, timeout)?;
        if ctx.stopping.load(Ordering::Acquire) {
            return Ok(());
        }
        for &(token, _) in &events {
            match token {
                TOKEN_STOP => return Ok(()),
                TOKEN_LISTENER => loop {
                    let sock = match crate::sys::tcp_accept(listener) {
                        Ok(s) => s,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        // Out of fds or memory: leave the rest in the backlog for a moment.
                        Err(_) => break,
                    };
                    if pending.len() >= ctx.config.max_handshakes {
                        ctx.refused("handshakes in progress at the limit");
                        let _ = io::Write::write(
                            &mut &sock,
                            &Handshake::reject(ctx.id, RejectReason::Limit).encode(),
                        );
                        continue;
                    }
                    let Ok(inc) = Incoming::new(sock, ctx.config.handshake_timeout) else {
                        continue;
                    };
                    if epoll.add(inc.fd(), READABLE, next_token).is_ok() {
                        pending.insert(next_token, inc);
                        next_token += 1;
                    }
                },
                token => {
                    let Some(inc) = pending.get_mut(&token) else { continue };
                    let mut check = |h: &Handshake| ctx.check_hello(h);
                    match inc.advance(ctx.id, key.as_deref(), &ctx.tcp_options, &mut check) {
                        Progress::Pending => {}
                        Progress::Failed(why) => {
                            let inc = pending.remove(&token).expect("present");
                            let _ = epoll.delete(inc.fd());
                            ctx.handshake_failed(inc.peer, why);
                        }
                        Progress::Confirmed(hello) => {
                            let inc = pending.remove(&token).expect("present");
                            let _ = epoll.delete(inc.fd());
                            ctx.admit(inc, hello);
                        }
                    }
                }
            }
        }
        let now = Instant::now();
        let expired: Vec<u64> =
            pending.iter().filter(|(_, p)| p.deadline <= now).map(|(&t, _)| t).collect();
        for t in expired {
            let inc = pending.remove(&t).expect("present");
            let _ = epoll.delete(inc.fd());
            ctx.handshake_failed(inc.peer, "handshake timed out".into());
        }
    }
}
