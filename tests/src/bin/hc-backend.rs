//! A test backend: an HTTP/1.1 server (keep-alive aware) whose body names
//! the backend, and a UDP echo that prefixes the backend's name.
//!
//! `hc-backend --id NAME [--http PORT] [--udp PORT]`

use std::{
    io::{BufRead, BufReader, Write},
    net::{TcpListener, TcpStream, UdpSocket},
    thread,
    time::Duration,
};

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let id = arg(&args, "--id").unwrap_or_else(|| "backend".into());
    let http: u16 = arg(&args, "--http").map_or(8080, |p| p.parse().expect("--http PORT"));
    let udp: u16 = arg(&args, "--udp").map_or(5353, |p| p.parse().expect("--udp PORT"));

    let uid = id.clone();
    let sock = UdpSocket::bind(("0.0.0.0", udp)).expect("bind UDP");
    thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while let Ok((n, peer)) = sock.recv_from(&mut buf) {
            let mut reply = format!("{uid}:").into_bytes();
            reply.extend_from_slice(&buf[..n]);
            let _ = sock.send_to(&reply, peer);
        }
    });

    let listener = TcpListener::bind(("0.0.0.0", http)).expect("bind HTTP");
    for stream in listener.incoming().flatten() {
        let id = id.clone();
        thread::spawn(move || serve(stream, &id));
    }
}

fn serve(stream: TcpStream, id: &str) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(120)));
    let _ = stream.set_nodelay(true);
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    loop {
        let mut keep_alive = false;
        let mut line = String::new();
        if matches!(reader.read_line(&mut line), Ok(0) | Err(_)) {
            return;
        }
        let mut http11 = line.contains("HTTP/1.1");
        loop {
            let mut h = String::new();
            match reader.read_line(&mut h) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let lower = h.to_ascii_lowercase();
            if lower.starts_with("connection:") {
                keep_alive = lower.contains("keep-alive");
                if lower.contains("close") {
                    http11 = false;
                }
            }
            if h == "\r\n" || h == "\n" {
                break;
            }
        }
        let keep = keep_alive || http11;
        let body = format!("{id}\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: {}\r\n\r\n{body}",
            body.len(),
            if keep { "keep-alive" } else { "close" }
        );
        if out.write_all(resp.as_bytes()).is_err() || !keep {
            return;
        }
    }
}
