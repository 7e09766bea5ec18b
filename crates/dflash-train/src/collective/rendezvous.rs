//! How the ranks of a multi-process group find each other: rank 0 listens on `HOST:PORT`
//! and hands the group's 128-byte NCCL id to each of the other ranks, which connect to it
//! (as torchrun's `--rdzv-endpoint`). Example: 2 nodes × 8 GPUs, `--rendezvous 10.0.0.1:29511`:
//! rank 0 (node 0, GPU 0) listens on 10.0.0.1:29511 and serves the id 15 times.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Rank 0: accept `world − 1` connections on `addr` and send `id` to each; gives up after
/// `wait` without all of them.
pub fn serve(addr: &str, id: &[u8; 128], world: usize, wait: Duration) -> Result<()> {
    let listener = TcpListener::bind(addr)
        .with_context(|| format!("rendezvous: cannot listen on {addr} (is the port in use?)"))?;
    listener.set_nonblocking(true)?;
    let started = Instant::now();
    let mut served = 0;
    while served + 1 < world {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.write_all(id)?;
                served += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if started.elapsed() > wait {
                    bail!(
                        "rendezvous on {addr}: {served} of {} ranks came within {wait:?}",
                        world - 1
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context("rendezvous: accept"),
        }
    }
    Ok(())
}

/// Another rank: connect to rank 0 at `addr` (retrying until `wait` has passed: rank 0 may
/// not listen yet) and read the id.
pub fn fetch(addr: &str, wait: Duration) -> Result<[u8; 128]> {
    let started = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(mut s) => {
                let mut id = [0u8; 128];
                s.read_exact(&mut id)
                    .with_context(|| format!("rendezvous: reading the group id from {addr}"))?;
                return Ok(id);
            }
            Err(e) if started.elapsed() > wait => {
                return Err(e).with_context(|| {
                    format!("rendezvous: rank 0 at {addr} not reached within {wait:?}")
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let addr = "127.0.0.1:29517";
        let id: [u8; 128] = std::array::from_fn(|i| (i * 7) as u8);
        let wait = Duration::from_secs(20);
        std::thread::scope(|s| {
            // the others start first: they retry until rank 0 listens
            let hs: Vec<_> = (0..3).map(|_| s.spawn(|| fetch(addr, wait))).collect();
            std::thread::sleep(Duration::from_millis(100));
            serve(addr, &id, 4, wait).unwrap();
            for h in hs {
                assert_eq!(h.join().unwrap().unwrap(), id);
            }
        });
    }

    #[test]
    fn a_missing_rank_is_named_after_the_wait() {
        let e = serve("127.0.0.1:29518", &[0; 128], 2, Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(e.contains("0 of 1 ranks"), "{e}");
    }
}
