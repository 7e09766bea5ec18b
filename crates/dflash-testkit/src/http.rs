//! A server process under test and a small HTTP/1.1 client over real sockets: requests with a
//! JSON body, whole responses (`Content-Length` or chunked) and server-sent event streams read
//! event by event.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A `dflash-rs serve` (or any server printing `listening on http://ADDR` on stderr) started
/// for a test; killed when dropped.
pub struct ServerProcess {
    child: Child,
    pub addr: String,
    /// Stderr lines after the address line, read by a thread.
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Start `bin args…` and wait (≤ 120 s) for its address.
    pub fn start(bin: &str, args: &[&str]) -> Self {
        let mut child = Command::new(bin)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the server");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let addr = loop {
            match lines.next() {
                Some(Ok(l)) => {
                    if let Some(a) = l.strip_prefix("listening on http://") {
                        break a.to_string();
                    }
                    seen.push(l);
                }
                _ => {
                    let _ = child.kill();
                    panic!("the server exited before listening:\n{}", seen.join("\n"));
                }
            }
        };
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = log.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                sink.lock().unwrap().push(l);
            }
        });
        ServerProcess { child, addr, log }
    }

    /// Send SIGTERM.
    pub fn term(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill -TERM failed");
    }

    /// Wait (≤ `secs`) for the process to exit.
    pub fn wait(&mut self, secs: u64) -> ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                return s;
            }
            assert!(
                t.elapsed().as_secs() < secs,
                "the server did not exit in {secs} s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The process's resident memory in KiB (`VmRSS` of /proc), where there is a /proc.
    pub fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// A request to this server.
    pub fn request(&self, method: &str, path: &str, body: Option<&str>) -> Response {
        request(&self.addr, method, path, body)
    }

    /// POST a JSON body and open its event stream.
    pub fn stream(&self, path: &str, body: &str) -> EventStream {
        EventStream::open(&self.addr, path, body)
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A whole response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

fn send(addr: &str, method: &str, path: &str, body: Option<&str>) -> BufReader<TcpStream> {
    let mut s = TcpStream::connect(addr).expect("connecting to the server");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    BufReader::new(s)
}

/// The status line and headers.
fn head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).expect("reading the status line");
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            return (status, headers);
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
}

/// One request on its own connection, read to its end.
pub fn request(addr: &str, method: &str, path: &str, body: Option<&str>) -> Response {
    let mut r = send(addr, method, path, body);
    let (status, headers) = head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut bytes = Vec::new();
    if chunked {
        while let Some(c) = chunk(&mut r) {
            bytes.extend(c);
        }
    } else {
        r.read_to_end(&mut bytes).unwrap();
    }
    Response {
        status,
        headers,
        body: String::from_utf8(bytes).expect("a UTF-8 body"),
    }
}

/// The next chunk of a chunked body (`None` at its end).
fn chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut size = String::new();
    if r.read_line(&mut size).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
    let mut buf = vec![0; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    (n > 0).then_some(buf)
}

/// A server-sent event stream, read one `data:` payload at a time.
pub struct EventStream {
    r: Option<BufReader<TcpStream>>,
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pending: String,
    /// A non-stream body (an error) when the server did not stream.
    pub body: Option<String>,
}

impl EventStream {
    fn open(addr: &str, path: &str, body: &str) -> Self {
        let mut r = send(addr, "POST", path, Some(body));
        let (status, headers) = head(&mut r);
        let is_sse = headers.iter().any(|(k, v)| {
            k.eq_ignore_ascii_case("content-type") && v.starts_with("text/event-stream")
        });
        let mut s = EventStream {
            r: Some(r),
            status,
            headers,
            pending: String::new(),
            body: None,
        };
        if !is_sse {
            let mut b = Vec::new();
            if let Some(mut r) = s.r.take() {
                let _ = r.read_to_end(&mut b);
            }
            s.body = Some(String::from_utf8_lossy(&b).into_owned());
        }
        s
    }

    /// The next event's data (`None` when the stream ended).
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.pending.find("\n\n") {
                let ev: String = self.pending.drain(..i + 2).collect();
                let data: Vec<&str> = ev
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return Some(data.join("\n"));
            }
            let c = chunk(self.r.as_mut()?)?;
            self.pending.push_str(&String::from_utf8_lossy(&c));
        }
    }

    /// Every remaining event's data, up to and without `[DONE]`; whether `[DONE]` came.
    pub fn rest(&mut self) -> (Vec<String>, bool) {
        let mut out = Vec::new();
        while let Some(d) = self.next_data() {
            if d == "[DONE]" {
                return (out, true);
            }
            out.push(d);
        }
        (out, false)
    }

    /// Close the connection (a client that goes away).
    pub fn close(mut self) {
        if let Some(r) = self.r.take() {
            let _ = r.get_ref().shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A T = 0 chat-completion body for `prompt` asking for the token ids, with `extra`'s fields
/// set over it.
pub fn chat_body(prompt: &str, max_tokens: usize, extra: serde_json::Value) -> String {
    let mut b = serde_json::json!({"messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0, "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b.to_string()
}

/// A response's token ids.
pub fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The sum of a Prometheus metric's samples in `/metrics` text (every label set).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
