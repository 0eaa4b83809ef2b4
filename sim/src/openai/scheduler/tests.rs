//! The batch model on a clock of its own: each event at the instant the model says, to the
//! microsecond.

use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Wake, Waker};

use super::rank::{Due, WORK};
use super::*;

/// 10 ms floor, 1 ms a prefill token, 10 ms a decode step alone.
fn limits(max_running: usize, decode_slowdown: f64) -> Limits {
    Limits {
        floor: Duration::from_millis(10),
        per_token: 1e-3,
        inter_token: 10e-3,
        max_running,
        decode_slowdown,
        chunk: None,
    }
}

struct Model {
    rank: Rank,
    limits: Limits,
    start: Instant,
    finished: Vec<(u64, Job, Instant)>,
}

impl Model {
    fn new(limits: Limits) -> Model {
        Model {
            rank: Rank::default(),
            limits,
            start: Instant::now(),
            finished: Vec::new(),
        }
    }

    fn at(&self, ms: f64) -> Instant {
        self.start + Duration::from_secs_f64(ms / 1e3)
    }

    fn run_to(&mut self, ms: f64) {
        let now = self.at(ms);
        self.rank.advance(now, &self.limits, &mut self.finished);
    }

    fn arrive(&mut self, id: u64, ms: f64, uncached: u32, max_tokens: u32) {
        self.run_to(ms);
        let now = self.at(ms);
        self.rank
            .arrive(id, uncached, max_tokens, now, &self.limits);
    }

    /// Job `id`'s client gone now.
    fn leave(&mut self, id: u64) {
        let now = self.rank.clock.expect("the rank has run");
        self.rank.leave(id, now, &self.limits);
    }

    fn ms(&self, instant: Instant) -> f64 {
        (instant - self.start).as_secs_f64() * 1e3
    }

    fn job(&self, id: u64) -> &Job {
        self.rank
            .jobs
            .get(&id)
            .or_else(|| self.finished.iter().find(|f| f.0 == id).map(|f| &f.1))
            .expect("the job is known")
    }

    fn first_token(&self, id: u64) -> f64 {
        self.ms(self.job(id).first_token.expect("the first token is made"))
    }

    fn left(&self, id: u64) -> f64 {
        let (_, _, at) = self
            .finished
            .iter()
            .find(|(left, _, _)| *left == id)
            .expect("the job left");
        self.ms(*at)
    }

    /// Runs the rank to each of its events in turn, as the answers watching them would;
    /// returns how many there were.
    fn event_by_event(&mut self) -> u64 {
        let mut events = 0;
        while let Some((at, _)) = self
            .rank
            .clock
            .and_then(|clock| self.rank.next_event(clock, &self.limits))
        {
            self.rank.advance(at, &self.limits, &mut self.finished);
            events += 1;
        }
        events
    }

    /// Job `id`'s answer waiting now for token `token`, woken through `waker`.
    fn wait(&mut self, id: u64, token: u32, waker: &Waker) -> Wait {
        let now = self.rank.clock.expect("the rank has run");
        self.rank.wait(id, token, waker, now, &self.limits)
    }

    fn due_ms(&self, id: u64, token: u32) -> f64 {
        match self.rank.due(id, token, &self.limits) {
            Due::At(at) => self.ms(at),
            other => panic!("job {id} token {token}: {other:?}"),
        }
    }
}

fn assert_ms(what: &str, got: f64, want: f64) {
    assert!(
        (got - want).abs() < 1e-3,
        "{what}: {got} ms, expected {want} ms"
    );
}

#[test]
fn a_lone_request_keeps_the_fixed_timeline() {
    let mut model = Model::new(limits(256, 0.5));
    model.arrive(0, 0.0, 100, 5);
    assert_ms("due at the floor", model.due_ms(0, 0), 10.0);
    model.run_to(20.0);
    assert_ms("first token due", model.due_ms(0, 0), 110.0);
    assert_ms("third token due", model.due_ms(0, 2), 130.0);
    model.run_to(1_000.0);
    assert_ms("first token", model.first_token(0), 110.0);
    assert_ms("last token", model.left(0), 150.0);
}

#[test]
fn prefills_run_first_come_first_served() {
    let mut model = Model::new(limits(256, 0.0));
    model.arrive(0, 0.0, 100, 1);
    model.arrive(1, 0.0, 100, 1);
    model.run_to(1_000.0);
    assert_ms("first", model.first_token(0), 110.0);
    assert_ms("second, after the first", model.first_token(1), 210.0);

    // 1 arrives while 0 prefills: its floor ends at 60 ms, it starts when 0 ends at 110 ms.
    let mut model = Model::new(limits(256, 0.0));
    model.arrive(0, 0.0, 100, 1);
    model.arrive(1, 50.0, 100, 1);
    model.run_to(100.0);
    assert_ms("0 due at the whole throughput", model.due_ms(0, 0), 110.0);
    assert_ms("1 due after it", model.due_ms(1, 0), 210.0);
    model.run_to(1_000.0);
    assert_ms("first", model.first_token(0), 110.0);
    assert_ms("second", model.first_token(1), 210.0);
}

/// A prefill whose client goes away gives its turn back: those behind it start sooner by what
/// it had left, and those before it are as they were.
#[test]
fn a_prefill_that_leaves_moves_the_ones_behind_it_up() {
    // Three of 100 ms in line from 10 ms; one leaves at 60 ms, the first halfway through.
    for (leaver, expected) in [(0, [(1, 160.0), (2, 260.0)]), (2, [(0, 110.0), (1, 210.0)])] {
        let mut model = Model::new(limits(256, 0.0));
        for id in 0..3 {
            model.arrive(id, 0.0, 100, 1);
        }
        model.run_to(60.0);
        model.leave(leaver);
        model.run_to(1_000.0);
        for (id, at) in expected {
            assert_ms(
                &format!("{id} after {leaver} left"),
                model.first_token(id),
                at,
            );
        }
    }
}

#[test]
fn past_max_running_a_request_waits_its_turn() {
    let mut model = Model::new(limits(1, 0.0));
    model.arrive(0, 0.0, 100, 5);
    model.arrive(1, 20.0, 100, 5);
    model.arrive(2, 30.0, 0, 1);
    model.run_to(100.0);
    assert_eq!(model.rank.running(), 1);
    assert_eq!(model.rank.jobs.len(), 3);
    assert_ms("1 looks again at 0's next event", model.due_ms(1, 0), 110.0);
    model.run_to(1_000.0);
    assert_ms("0 leaves", model.left(0), 150.0);
    assert_ms("1 admitted then", model.first_token(1), 260.0);
    assert_ms("2 after 1, in arrival order", model.first_token(2), 310.0);
    assert!(model.rank.jobs.is_empty());
}

#[test]
fn decode_steps_slow_with_the_batch_and_speed_up_as_it_empties() {
    let mut model = Model::new(limits(256, 0.5));
    for id in 0..3 {
        model.arrive(id, 0.0, 0, 11);
    }
    model.run_to(1_000.0);
    for id in 0..3 {
        assert_ms("first token", model.first_token(id), 10.0);
        // 20 ms a step with three in the batch.
        assert_ms("last token", model.left(id), 210.0);
    }

    // Two in the batch: 15 ms a step; 1 leaves after 2 steps, then 0 makes its last 8 tokens
    // alone at 10 ms.
    let mut model = Model::new(limits(256, 0.5));
    model.arrive(0, 0.0, 0, 11);
    model.arrive(1, 0.0, 0, 3);
    model.run_to(1_000.0);
    assert_ms("1 leaves", model.left(1), 40.0);
    assert_ms("0 leaves", model.left(0), 120.0);
}

#[test]
fn a_request_with_nothing_to_wait_for_is_done_at_once() {
    let mut model = Model::new(Limits {
        floor: Duration::ZERO,
        per_token: 0.0,
        inter_token: 0.0,
        max_running: 1,
        decode_slowdown: 0.0,
        chunk: None,
    });
    for id in 0..3 {
        model.arrive(id, 0.0, 50, 16);
    }
    model.run_to(0.0);
    for id in 0..3 {
        assert_ms("left", model.left(id), 0.0);
    }
}

#[test]
fn a_chunked_prefill_beside_decodes_slows_them_and_goes_at_the_chunks_share() {
    // 10 prompt tokens a step: 10 ms more a step, the prefill at half its lone speed.
    let mut model = Model::new(Limits {
        chunk: Some(10e-3),
        ..limits(256, 0.0)
    });
    model.arrive(0, 0.0, 0, 101);
    model.arrive(1, 50.0, 100, 1);
    model.run_to(100.0);
    // 0 made 5 tokens alone by 60 ms, then 2 a step of 20 ms.
    assert_ms("0's 10th token due", model.due_ms(0, 10), 160.0);
    model.run_to(2_000.0);
    assert_ms("1's prefill at half speed", model.first_token(1), 260.0);
    // 15 tokens by 260 ms, the last 85 alone at 10 ms.
    assert_ms("0 leaves", model.left(0), 1_110.0);

    // Prefills alone still go at the whole throughput.
    let mut model = Model::new(Limits {
        chunk: Some(10e-3),
        ..limits(256, 0.0)
    });
    model.arrive(0, 0.0, 100, 1);
    model.arrive(1, 0.0, 100, 1);
    model.run_to(1_000.0);
    assert_ms("first", model.first_token(0), 110.0);
    assert_ms("second, after it", model.first_token(1), 210.0);
}

#[test]
fn settings_no_rank_could_run_with_are_refused() {
    let refused = |config: OpenAiConfig| Limits::new(&config).err();
    assert_eq!(refused(OpenAiConfig::default()), None);
    assert_eq!(refused(OpenAiConfig::gpu_8b()), None);
    let config = |max_running, decode_slowdown, prefill_chunk| OpenAiConfig {
        max_running,
        decode_slowdown,
        prefill_chunk,
        ..OpenAiConfig::gpu_8b()
    };
    assert_eq!(
        refused(config(0, 0.0, None)),
        Some(BatchConfigError::NoPlace)
    );
    assert_eq!(
        refused(config(1, -0.5, None)),
        Some(BatchConfigError::Slowdown(-0.5))
    );
    assert!(matches!(
        refused(config(1, f64::NAN, None)),
        Some(BatchConfigError::Slowdown(_))
    ));
    assert_eq!(
        refused(config(1, 0.0, Some(0))),
        Some(BatchConfigError::EmptyChunk)
    );
}

/// Counts the wakes of every answer it is given to.
#[derive(Default)]
struct Wakes(AtomicU64);

impl Wake for Wakes {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Work (marks compared, jobs visited) and wakes per event, with `n` decoding requests on a
/// rank, each with its answer waiting for its next token and leaving at a step of its own,
/// every departure speeding the others up.
fn decoding_cost(n: u32) -> (f64, f64) {
    let wakes = Arc::new(Wakes::default());
    let waker = Waker::from(Arc::clone(&wakes));
    let mut model = Model::new(limits(usize::MAX, 0.5));
    for id in 0..n {
        model.arrive(u64::from(id), 0.0, 0, 3 + id);
    }
    model.run_to(10.0);
    assert_eq!(model.rank.running(), n as usize);
    WORK.with(|work| work.set(0));
    for id in 0..n {
        assert!(matches!(
            model.wait(u64::from(id), 1 + id, &waker),
            Wait::Until(_)
        ));
    }
    let events = model.event_by_event();
    assert!(model.rank.jobs.is_empty());
    assert_eq!(events, u64::from(n), "one event a request leaving");
    let work = WORK.with(|work| work.get()) as f64 / events as f64;
    let wakes = wakes.0.load(Ordering::Relaxed) as f64 / events as f64;
    (work, wakes)
}

#[test]
fn ten_thousand_decoding_requests_cost_a_logarithm_an_event() {
    let (work_1k, wakes_1k) = decoding_cost(1_000);
    let (work_10k, wakes_10k) = decoding_cost(10_000);
    // A scan of the batch an event would be ten times the work at ten times the requests; a
    // logarithm is 4/3 of it (log 10,000 / log 1,000).
    assert!(
        work_10k < 1.6 * work_1k,
        "work an event: {work_1k} with 1,000 requests, {work_10k} with 10,000"
    );
    assert!(
        work_10k < 4.0 * 10_000f64.log2(),
        "work an event with 10,000 requests: {work_10k}"
    );
    // Its own answer and the next awaited token's, not every answer.
    for wakes in [wakes_1k, wakes_10k] {
        assert!(wakes <= 3.0, "wakes an event: {wakes}");
    }
}

#[test]
fn only_the_first_waiting_request_watches_for_its_turn() {
    let wakes = Arc::new(Wakes::default());
    let waker = Waker::from(Arc::clone(&wakes));
    let mut model = Model::new(limits(1, 0.0));
    let n = 1_000;
    for id in 0..n {
        model.arrive(id, 0.0, 10, 3);
    }
    assert!(matches!(model.wait(0, 0, &waker), Wait::Until(_)));
    assert!(matches!(model.wait(1, 0, &waker), Wait::Until(_)));
    for id in 2..n {
        assert_eq!(model.wait(id, 0, &waker), Wait::Woken);
    }
    let events = model.event_by_event();
    assert!(model.rank.jobs.is_empty());
    // Each request: admitted, prefilling, first token, gone; and the firsts told of each event.
    let wakes = wakes.0.load(Ordering::Relaxed);
    assert!(
        wakes <= 4 * n + 3 * events,
        "{wakes} wakes for {n} requests in {events} events"
    );
}
