//! A standalone netchannel peer: an engine with an echo listener. Prints its channel address on
//! stdout, then echoes every virtual socket until killed. Used by tests that kill a peer process
//! and handy for trying the stack by hand.
//!
//! usage: nc-echo [--listen ADDR] [--port VPORT] [--netns PATH] [--psk-file PATH]
//!                [--max-sessions N]

use std::io::Write;
use std::net::SocketAddr;

use netchannel::{Config, Engine};

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
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let engine = Engine::new(config)?;
    let listener = engine.listen(port)?;
    println!("{}", engine.local_addr());
    std::io::stdout().flush()?;
    loop {
        let sock = listener.accept()?;
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = sock.recv(&mut buf) {
                if n == 0 || sock.send(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = sock.shutdown();
        });
    }
}
