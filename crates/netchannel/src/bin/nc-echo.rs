//! A standalone netchannel peer: an engine with an echo listener. Prints its channel address on
//! stdout, then echoes every virtual socket until killed. Used by tests that attack a peer
//! process or kill one, and handy for trying the stack by hand.
//!
//! One event loop serves every stream (non-blocking sockets in a `Poller`, woken also by the
//! listener): the process has the engine's threads and this one, whatever the number of
//! streams. Each stream holds at most one read (16 KiB) that it could not echo yet; while it
//! does, it is not read, so a peer that does not read its echoes is slowed by the windows, not
//! served from memory.
//!
//! usage: nc-echo [--listen ADDR] [--port VPORT] [--netns PATH] [--psk-file PATH]
//!                [--max-sessions N] [--max-peer-buffered BYTES] [--max-send-buffered BYTES]
//!                [--max-channels-per-source N] [--max-handshakes-per-source N]
//!                [--ack-timeout-ms MS] [--user-timeout-ms MS]

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::time::Duration;

use netchannel::{Config, Engine, Poller, VSocket};

fn main() {
    if let Err(e) = run() {
        eprintln!("nc-echo: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = Config::default();
    let mut port = 7u16;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen" => config.listen_addr = value()?.parse::<SocketAddr>()?,
            "--port" => port = value()?.parse()?,
            "--netns" => config.netns = Some(value()?.into()),
            "--psk-file" => config.psk = Some(std::fs::read(value()?)?),
            "--max-sessions" => config.max_sessions = value()?.parse()?,
            "--max-peer-buffered" => config.max_peer_buffered = value()?.parse()?,
            "--max-send-buffered" => config.max_send_buffered = value()?.parse()?,
            "--max-channels-per-source" => config.max_channels_per_source = value()?.parse()?,
            "--max-handshakes-per-source" => config.max_handshakes_per_source = value()?.parse()?,
            "--ack-timeout-ms" => config.ack_timeout = Duration::from_millis(value()?.parse()?),
            "--user-timeout-ms" => config.user_timeout = Duration::from_millis(value()?.parse()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let engine = Engine::new(config)?;
    let listener = engine.listen(port)?;
    listener.set_nonblocking(true);
    println!("{}", engine.local_addr());
    io::stdout().flush()?;
    let poller = Poller::new()?;
    poller.wake_on(listener.readiness_fd()?);
    let mut streams: HashMap<u64, Echo> = HashMap::new();
    let mut next = 0u64;
    let mut tokens = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // The listener's readiness is an edge: accept everything pending before each wait.
        listener.clear_readiness();
        loop {
            match listener.accept() {
                Ok(sock) => {
                    sock.set_nonblocking(true);
                    next += 1;
                    if poller.register(&sock, next).is_ok() {
                        streams.insert(next, Echo { sock, pending: Vec::new(), eof: false });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e.into()),
            }
        }
        poller.wait(&mut tokens, None)?;
        for t in &tokens {
            let Some(e) = streams.get_mut(t) else { continue };
            if !e.serve(&mut buf) {
                streams.remove(t);
            }
        }
    }
}

/// One stream being echoed.
struct Echo {
    sock: VSocket,
    /// Read and not echoed yet (the peer's window was full).
    pending: Vec<u8>,
    eof: bool,
}

impl Echo {
    /// Echoes what can move now; false when the stream is done (or failed).
    fn serve(&mut self, buf: &mut [u8]) -> bool {
        loop {
            while !self.pending.is_empty() {
                match self.sock.send(&self.pending) {
                    Ok(n) => {
                        self.pending.drain(..n);
                        if self.pending.is_empty() {
                            self.pending = Vec::new(); // a blocked stream's memory, given back
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                    Err(_) => return false,
                }
            }
            if self.eof {
                let _ = self.sock.shutdown();
                return false;
            }
            match self.sock.recv(buf) {
                Ok(0) => self.eof = true,
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(_) => return false,
            }
        }
    }
}
