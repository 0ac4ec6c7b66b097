//! Slowloris: clients that open connections and send a request head that
//! never ends (a header line every so often, never the blank line), so no
//! server ever answers them. To the kernel the balancer's backends then
//! owe answers they will never give; the balancer must not take that for
//! a hang.

use huddle_user::sys::netns::Netns;
use std::{
    io::Write,
    net::{SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

/// Clients holding request heads open, from one thread.
pub struct Slowloris {
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
    /// Connections opened so far (each closed one is opened again).
    pub opened: Arc<AtomicU64>,
}

impl Slowloris {
    /// Keeps `conns` connections from namespace `ns` to `vip`, each
    /// writing a header line every `every`; bounded to 10 minutes even if
    /// never stopped.
    #[must_use]
    pub fn start(ns: &Netns, vip: SocketAddr, conns: usize, every: Duration) -> Slowloris {
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicU64::new(0));
        let (s, o, ns) = (stop.clone(), opened.clone(), ns.name.clone());
        let handle = thread::spawn(move || {
            huddle_user::sys::netns::enter(&ns).expect("enter client namespace");
            let open = || -> Option<TcpStream> {
                let mut c = TcpStream::connect_timeout(&vip, Duration::from_secs(2)).ok()?;
                c.set_write_timeout(Some(Duration::from_secs(1))).ok()?;
                c.write_all(b"GET / HTTP/1.1\r\nHost: vip\r\n").ok()?;
                o.fetch_add(1, Ordering::Relaxed);
                Some(c)
            };
            let mut held: Vec<Option<TcpStream>> = (0..conns).map(|_| open()).collect();
            let deadline = Instant::now() + Duration::from_secs(600);
            let mut line = 0u64;
            while !s.load(Ordering::Relaxed) && Instant::now() < deadline {
                let round = Instant::now();
                for c in &mut held {
                    line += 1;
                    let h = format!("X-Line-{line}: still coming\r\n");
                    let alive = c
                        .as_mut()
                        .is_some_and(|c| c.write_all(h.as_bytes()).is_ok());
                    if !alive {
                        *c = open();
                    }
                }
                while round.elapsed() < every && !s.load(Ordering::Relaxed) {
                    thread::sleep(Duration::from_millis(50));
                }
            }
        });
        Slowloris {
            stop,
            handle: Some(handle),
            opened,
        }
    }

    /// Closes every connection.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Slowloris {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
