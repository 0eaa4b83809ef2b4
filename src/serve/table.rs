//! Path tables: each API declares every path it answers once, with its method, its guard, its
//! handler and where the handler runs (`Handler::Here` or `Handler::Pool`), and `dispatch` is
//! the one place a request meets them.
//!
//! Owns: matching a path against the declared patterns (`/reservations/{id}`: literal segments
//! equal, each `{param}` one non-empty segment), the 404 for a path no entry declares, the 405
//! (with `Allow`) for a declared path asked with another method, the 401 of a guarded path,
//! and where a request is answered (`runs`). Never: answers a path with another entry's
//! answer, runs a handler before its guard, or sends a refusal to the pool.

use http::Method;

use super::auth::{is_authorized, unauthorized};
use super::{Reply, Request};
use crate::auth::CurrentSecret;

/// The method a path answers. `Get` answers `HEAD` too (without the body).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Verb {
    Get,
    Post,
    Delete,
}

impl Verb {
    fn allows(self, method: &Method) -> bool {
        match self {
            Verb::Get => method == Method::GET || method == Method::HEAD,
            Verb::Post => method == Method::POST,
            Verb::Delete => method == Method::DELETE,
        }
    }

    /// The `Allow` header of a 405.
    fn allow(self) -> &'static str {
        match self {
            Verb::Get => "GET, HEAD",
            Verb::Post => "POST",
            Verb::Delete => "DELETE",
        }
    }
}

/// Who may call a path.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Guard {
    Open,
    /// Only with the secret (`auth_token_file`), when one is set.
    Secret,
}

/// What a handler is given: the request, its whole body, and the values of the pattern's
/// `{params}`, in order.
pub(crate) struct Call<'a> {
    pub(crate) request: &'a Request,
    pub(crate) body: &'a [u8],
    pub(crate) params: Params<'a>,
}

/// A pattern's parameters: at most `MAX_PARAMS`.
#[derive(Default)]
pub(crate) struct Params<'a>([&'a str; MAX_PARAMS]);

const MAX_PARAMS: usize = 2;

impl<'a> Params<'a> {
    pub(crate) fn get(&self, n: usize) -> &'a str {
        self.0.get(n).copied().unwrap_or_default()
    }
}

/// One declared path; `H` is what answers it: a handler of an API `A` (`Handler<A>`), or what
/// an asynchronous front end matches on.
pub(crate) struct Entry<H: 'static> {
    pub(crate) verb: Verb,
    /// The path, with `{name}` for a segment the handler reads.
    pub(crate) pattern: &'static str,
    pub(crate) guard: Guard,
    pub(crate) handler: H,
}

/// A whole-answer API's handler, and where it runs: the table says it once for each path, so
/// that only the work that needs a blocking thread waits for one.
pub(crate) enum Handler<A: 'static> {
    /// Reads a flag, a published value or a short lock: answered on the runtime's thread, as
    /// soon as its body is read, never waiting for a place in the pool.
    Here(fn(&A, Call<'_>) -> Reply),
    /// Hashes and walks the index, tokenizes, writes an answer that grows with the fleet, or
    /// waits on a lock a reload holds: answered on a blocking thread, one of `POOL_THREADS`.
    Pool(fn(&A, Call<'_>) -> Reply),
}

/// Where a request is answered (`Handler`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runs {
    Here,
    Pool,
}

impl<H> Entry<H> {
    /// The pattern's parameters if `path` matches it.
    fn matches<'p>(&self, path: &'p str) -> Option<Params<'p>> {
        let mut params = Params::default();
        let mut taken = 0;
        let mut wanted = self.pattern.split('/');
        let mut given = path.split('/');
        loop {
            match (wanted.next(), given.next()) {
                (None, None) => return Some(params),
                (Some(want), Some(got)) if want.starts_with('{') && want.ends_with('}') => {
                    if got.is_empty() || taken == MAX_PARAMS {
                        return None;
                    }
                    params.0[taken] = got;
                    taken += 1;
                }
                (Some(want), Some(got)) if want == got => {}
                _ => return None,
            }
        }
    }
}

/// Answers `request` from `table`: the first entry whose pattern and method match, behind its
/// guard; else 405 if an entry declares the path with another method, else 404.
pub(crate) fn dispatch<A>(
    table: &[Entry<Handler<A>>],
    api: &A,
    secret: &CurrentSecret,
    request: &Request,
    body: &[u8],
) -> Reply {
    match find(table, secret, request) {
        Ok((Handler::Here(handler) | Handler::Pool(handler), params)) => {
            let call = Call {
                request,
                body,
                params,
            };
            handler(api, call)
        }
        Err(refused) => refused,
    }
}

/// Where `request` is answered: its handler's place, or here for a path no entry answers
/// with its method (a 404 or 405 costs nothing). The guard is not asked: a 401 is answered
/// where its handler would run.
pub(crate) fn runs<A>(table: &[Entry<Handler<A>>], request: &Request) -> Runs {
    let path = request.path();
    let entry = table
        .iter()
        .find(|entry| entry.verb.allows(request.method()) && entry.matches(path).is_some());
    match entry.map(|entry| &entry.handler) {
        Some(Handler::Pool(_)) => Runs::Pool,
        Some(Handler::Here(_)) | None => Runs::Here,
    }
}

/// The entry of `table` that answers `request`, behind its guard, with the pattern's
/// parameters; else the 401, 404 or 405 to answer.
pub(crate) fn find<'t, 'r, H>(
    table: &'t [Entry<H>],
    secret: &CurrentSecret,
    request: &'r Request,
) -> Result<(&'t H, Params<'r>), Reply> {
    let path = request.path();
    let mut declared: Option<Verb> = None;
    for entry in table {
        let Some(params) = entry.matches(path) else {
            continue;
        };
        if !entry.verb.allows(request.method()) {
            declared.get_or_insert(entry.verb);
            continue;
        }
        if entry.guard == Guard::Secret && !is_authorized(request, secret.get().as_ref()) {
            return Err(unauthorized());
        }
        return Ok((&entry.handler, params));
    }
    Err(match declared {
        Some(verb) => {
            let reply = Reply::error(
                405,
                format!(
                    "{} {path}: method not allowed; use {}",
                    request.method(),
                    verb.allow()
                ),
            );
            reply.with_header("Allow", verb.allow())
        }
        None => Reply::error(404, format!("no such path: {path}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pattern: &'static str) -> Entry<()> {
        Entry {
            verb: Verb::Get,
            pattern,
            guard: Guard::Open,
            handler: (),
        }
    }

    #[test]
    fn a_pattern_matches_its_literals_and_one_segment_per_param() {
        let reservation = entry("/reservations/{id}/prefill_complete");
        let params = reservation
            .matches("/reservations/17/prefill_complete")
            .expect("matches");
        assert_eq!(params.get(0), "17");
        for other in [
            "/reservations/17",
            "/reservations//prefill_complete",
            "/reservations/17/prefill_complete/",
            "/reservations/1/7/prefill_complete",
            "/reservations/17/prefill_completed",
        ] {
            assert!(reservation.matches(other).is_none(), "{other}");
        }
        let snapshot = entry("/snapshot/{engine}/{dp_rank}");
        let params = snapshot.matches("/snapshot/vllm-a/3").expect("matches");
        assert_eq!((params.get(0), params.get(1)), ("vllm-a", "3"));
        assert!(snapshot.matches("/snapshot/vllm-a").is_none());
        assert!(entry("/health").matches("/health").is_some());
        assert!(entry("/health").matches("/health/").is_none());
        assert!(entry("/health").matches("/healthz").is_none());
    }
}

#[cfg(test)]
mod placing {
    use super::{runs, Entry, Guard, Handler, Runs, Verb};
    use crate::serve::request::test_request;
    use crate::serve::Reply;

    fn ok(_: &(), _: super::Call<'_>) -> Reply {
        Reply::error(200, "")
    }

    static TABLE: &[Entry<Handler<()>>] = &[
        Entry {
            verb: Verb::Get,
            pattern: "/health",
            guard: Guard::Open,
            handler: Handler::Here(ok),
        },
        Entry {
            verb: Verb::Post,
            pattern: "/query/{model}",
            guard: Guard::Secret,
            handler: Handler::Pool(ok),
        },
    ];

    /// A request is answered where its path's handler runs; one no entry answers (a 404 or a
    /// 405) is refused at once, never waiting for a place in the pool.
    #[test]
    fn a_request_runs_where_its_entry_says_and_a_refusal_at_once() {
        for (method, target, place) in [
            ("GET", "/health", Runs::Here),
            ("HEAD", "/health", Runs::Here),
            ("GET", "/health?verbose=1", Runs::Here),
            ("POST", "/query/m", Runs::Pool),
            ("POST", "/query/m?x=1", Runs::Pool),
            ("POST", "/health", Runs::Here),
            ("GET", "/query/m", Runs::Here),
            ("POST", "/query/", Runs::Here),
            ("GET", "/healthz", Runs::Here),
        ] {
            let request = test_request(method, target);
            assert_eq!(runs(TABLE, &request), place, "{method} {target}");
        }
    }
}
