//! Connections whose placeholder outlives this process's fds for it (a forked child, or a
//! process it was sent to, still holds a copy): one thread waits for L to report that the
//! last copy of P is closed, wherever it was, and then ends the connection as TCP's last close.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use netchannel::sys::Epoll;
use parking_lot::Mutex;

use crate::carried::Carried;
use crate::process::{fd_base, inside};

struct Reaper {
    epoll: Epoll,
    waiting: Mutex<HashMap<u64, Arc<Carried>>>,
}

fn reaper() -> Option<&'static Reaper> {
    static R: OnceLock<Option<&'static Reaper>> = OnceLock::new();
    *R.get_or_init(|| {
        let epoll = Epoll::new().and_then(|e| e.moved_above(fd_base())).ok()?;
        let r: &'static Reaper =
            Box::leak(Box::new(Reaper { epoll, waiting: Mutex::new(HashMap::new()) }));
        std::thread::Builder::new()
            .name("nc-reaper".into())
            .spawn(move || inside(|| run(r)))
            .ok()?;
        Some(r)
    })
}

/// Ends `c` once L reports that no copy of its placeholder is left.
pub(crate) fn watch(c: Arc<Carried>) {
    let Some(r) = reaper() else { return };
    let id = c.id;
    // L reports POLLHUP (always reported, whatever the interest) when P's last copy closes.
    let added = c.with_l(|l| l.map(|l| r.epoll.add(l, 0, id).is_ok()));
    match added {
        Some(true) => {
            r.waiting.lock().insert(id, c);
        }
        // L is closed already (a terminal state): nothing is left to wait for.
        _ => c.finish(),
    }
}

/// Stops waiting for `id` (its L was closed: the kernel dropped it from the epoll set).
pub(crate) fn unwatch(id: u64) {
    if let Some(r) = reaper() {
        r.waiting.lock().remove(&id);
    }
}

fn run(r: &Reaper) {
    let mut events = Vec::new();
    loop {
        events.clear();
        if r.epoll.wait(&mut events, 64, None).is_err() {
            return;
        }
        for &(id, _) in &events {
            let c = r.waiting.lock().remove(&id);
            if let Some(c) = c {
                c.with_l(|l| {
                    if let Some(l) = l {
                        let _ = r.epoll.delete(l);
                    }
                });
                c.finish();
            }
        }
    }
}
