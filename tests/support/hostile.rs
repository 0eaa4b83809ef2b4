//! Peers that misbehave on purpose, over real sockets on 127.0.0.1, for the recovery tests
//! (`listener_snapshot`, `listener_replay`, `listener_fairness`): a hand-rolled HTTP/1.1 server answering what a
//! test scripts (bodies tiny_http would not give: a declared 10 GB, an endless stream, silence,
//! a byte every 2 s), and a replay ROUTER answering what a test scripts (one batch and then a
//! stall, or batches forever).
//!
//! It never asserts what a test expects; every thread it starts ends when its value is dropped.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_indexer_sim::encode::replay_frames;
use parking_lot::Mutex;

use super::fake_engine::payload;
use super::listeners::{store, DEADLINE};

/// How often the servers' threads look at their stop flag.
const STOP_POLL: Duration = Duration::from_millis(20);

/// An HTTP/1.1 server on loopback, a thread per connection: `answer` writes the response to
/// each connection and returns the bytes it got through before the client went away (or its
/// own limit). Every connection's count is recorded as it ends.
pub struct RawHttpServer {
    pub url: String,
    accepted: Arc<AtomicUsize>,
    written: Arc<Mutex<Vec<u64>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What a `RawHttpServer` does with one connection: given it and the server's stop flag.
pub type Answer = fn(&mut std::net::TcpStream, &AtomicBool) -> u64;

impl RawHttpServer {
    /// `answer` on every connection to `http://127.0.0.1:PORT/kv_recover`.
    pub fn start(answer: Answer) -> RawHttpServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind HTTP");
        listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}/kv_recover", listener.local_addr().unwrap());
        let written: Arc<Mutex<Vec<u64>>> = Arc::default();
        let accepted = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_written, thread_stop) = (Arc::clone(&written), Arc::clone(&stop));
        let thread_accepted = Arc::clone(&accepted);
        let thread = std::thread::spawn(move || {
            let mut connections = Vec::new();
            while !thread_stop.load(Ordering::Relaxed) {
                let Ok((mut stream, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                thread_accepted.fetch_add(1, Ordering::Relaxed);
                stream.set_nonblocking(false).unwrap();
                stream
                    .set_write_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                let (written, stop) = (Arc::clone(&thread_written), Arc::clone(&thread_stop));
                connections.push(std::thread::spawn(move || {
                    let count = answer(&mut stream, &stop);
                    written.lock().push(count);
                }));
            }
            for connection in connections {
                connection.join().unwrap();
            }
        });
        RawHttpServer {
            url,
            accepted,
            written,
            stop,
            thread: Some(thread),
        }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// The bytes written to the first connection to end, once it has.
    pub fn first_answer(&self) -> u64 {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(&count) = self.written.lock().first() {
                return count;
            }
            assert!(Instant::now() < deadline, "no snapshot request answered");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for RawHttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

/// Reads the request head (one read: the clients' requests are small).
pub fn read_request(stream: &mut std::net::TcpStream) {
    use std::io::Read;
    let mut request = [0u8; 4096];
    let _ = stream.read(&mut request);
}

/// An `Answer`: a 200 declaring a megabyte of JSON, then one byte of it every 2 s until the
/// client goes away or stop. Any per-read timeout above 2 s is defeated.
pub fn drip(stream: &mut std::net::TcpStream, stop: &AtomicBool) -> u64 {
    use std::io::Write;
    read_request(stream);
    let head =
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n";
    if stream.write_all(head.as_bytes()).is_err() {
        return 0;
    }
    let mut written = 0;
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() >= next {
            if stream.write_all(b" ").is_err() {
                break;
            }
            written += 1;
            next += Duration::from_secs(2);
        }
        std::thread::sleep(STOP_POLL);
    }
    written
}

/// The prompt of the batches `ScriptedReplay::stalling` makes up.
pub const STALLED_PROMPT: u32 = 777;

/// A replay ROUTER on an OS-picked port of 127.0.0.1, for any number of ranks, whose thread
/// hands each well-formed request `[identity, "", start_seq]` to a script until dropped.
pub struct ScriptedReplay {
    pub endpoint: String,
    requests: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What a `ScriptedReplay` does with a request: given its socket, the requester's identity,
/// the seq asked from and the stop flag (a script that keeps sending must look at it).
pub type Script = Box<dyn Fn(&zmq::Socket, &[u8], u64, &AtomicBool) + Send>;

impl ScriptedReplay {
    pub fn start(context: &zmq::Context, script: Script) -> ScriptedReplay {
        let router = context.socket(zmq::ROUTER).expect("ROUTER");
        router.set_linger(0).unwrap();
        router.bind("tcp://127.0.0.1:*").expect("bind ROUTER");
        let endpoint = router.get_last_endpoint().unwrap().unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (thread_requests, thread_stop) = (Arc::clone(&requests), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !thread_stop.load(Ordering::Relaxed) {
                if router
                    .poll(zmq::POLLIN, STOP_POLL.as_millis() as i64)
                    .unwrap()
                    == 0
                {
                    continue;
                }
                let request = router.recv_multipart(0).unwrap();
                let (Some(identity), Some(start)) = (request.first(), request.get(2)) else {
                    continue;
                };
                if let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) {
                    thread_requests.fetch_add(1, Ordering::Relaxed);
                    script(&router, identity, u64::from_be_bytes(start), &thread_stop);
                }
            }
        });
        ScriptedReplay {
            endpoint,
            requests,
            stop,
            thread: Some(thread),
        }
    }

    /// Well-formed requests handed to the script so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }

    /// Answers each request with one batch at the seq asked for (storing `STALLED_PROMPT`),
    /// then nothing: no more batches, no end marker.
    pub fn stalling(context: &zmq::Context) -> ScriptedReplay {
        let made_up = payload(0, vec![store(STALLED_PROMPT, 0, 1)]);
        ScriptedReplay::start(
            context,
            Box::new(move |router, identity, start, _| send(router, identity, start, &made_up)),
        )
    }
}

/// Sends one replayed batch to `identity` (new layout, empty topic). ROUTER drops what a gone
/// peer cannot take: this never blocks.
pub fn send(router: &zmq::Socket, identity: &[u8], seq: u64, payload: &[u8]) {
    let mut frames = vec![identity.to_vec()];
    frames.extend(replay_frames(Some(b""), seq, payload));
    router.send_multipart(frames, 0).unwrap();
}

impl Drop for ScriptedReplay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}
