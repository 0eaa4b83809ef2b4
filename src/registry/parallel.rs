//! Bounded fan-out for the registry's slow steps (starting and stopping listeners).
//!
//! Owns: running one closure over many items on a few scoped threads, results kept in order.
//! Never: outlives its call (scoped threads), or swallows a panic (it is resumed in the caller).

use parking_lot::Mutex;

/// `work` on every item, on up to `workers` threads; the results in the items' order.
pub(super) fn in_parallel<T: Send, R: Send>(
    items: Vec<T>,
    workers: usize,
    work: impl Fn(T) -> R + Sync,
) -> Vec<R> {
    if items.len() <= 1 {
        return items.into_iter().map(work).collect();
    }
    let count = items.len();
    let queue = Mutex::new(items.into_iter().enumerate());
    let next = || queue.lock().next();
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..workers.min(count))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some((at, item)) = next() {
                        done.push((at, work(item)));
                    }
                    done
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|thread| {
                thread
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    });
    done.sort_unstable_by_key(|(at, _)| *at);
    done.into_iter().map(|(_, result)| result).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_parallel_keeps_the_order_of_its_items() {
        let squares = in_parallel((0..100u64).collect(), 7, |n| n * n);
        assert_eq!(squares, (0..100u64).map(|n| n * n).collect::<Vec<_>>());
    }
}
