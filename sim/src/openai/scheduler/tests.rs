//! The batch model on a clock of its own: each event at the instant the model says, to the
//! microsecond.

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
    finished: Vec<(Job, Instant)>,
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

    fn ms(&self, instant: Instant) -> f64 {
        (instant - self.start).as_secs_f64() * 1e3
    }

    fn job(&self, id: u64) -> &Job {
        self.rank
            .jobs
            .iter()
            .chain(self.finished.iter().map(|(job, _)| job))
            .find(|job| job.id == id)
            .expect("the job is known")
    }

    fn first_token(&self, id: u64) -> f64 {
        self.ms(self.job(id).first_token.expect("the first token is made"))
    }

    fn left(&self, id: u64) -> f64 {
        let (_, at) = self
            .finished
            .iter()
            .find(|(job, _)| job.id == id)
            .expect("the job left");
        self.ms(*at)
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
fn concurrent_prefills_share_the_throughput() {
    let mut model = Model::new(limits(256, 0.0));
    model.arrive(0, 0.0, 100, 1);
    model.arrive(1, 0.0, 100, 1);
    model.run_to(1_000.0);
    assert_ms("first", model.first_token(0), 210.0);
    assert_ms("second", model.first_token(1), 210.0);

    // 0 alone from 10 to 60 ms (50 tokens), then both at half speed: 0's last 50 tokens end at
    // 160 ms, 1 has done 50 by then and does its last 50 alone.
    let mut model = Model::new(limits(256, 0.0));
    model.arrive(0, 0.0, 100, 1);
    model.arrive(1, 50.0, 100, 1);
    model.run_to(100.0);
    assert_ms("0 due at half speed", model.due_ms(0, 0), 160.0);
    model.run_to(1_000.0);
    assert_ms("first", model.first_token(0), 160.0);
    assert_ms("second", model.first_token(1), 210.0);
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
    assert_ms("first", model.first_token(0), 210.0);
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
