//! The open-addressing table both index maps are built on: linear probing, backward-shift
//! removal (no tombstones), storage straight from the OS for big tables.
//!
//! Owns memory layout and placement only; what an item means (its key, when it is vacant) is
//! the item type's business. It never locks and never looks inside an item beyond `Item`.
//!
//! Why its own storage: a table of a few MiB freed by growth must go back to the OS at once (the
//! allocator would keep it in its heap and the RSS would carry every table ever outgrown), and a
//! big table wants transparent huge pages: every probe of a multi-GiB index is a TLB miss on
//! 4 KiB pages. Big tables are therefore mapped with `mmap`, aligned to 2 MiB and marked
//! `MADV_HUGEPAGE`; fresh pages read as zeros, which is every item's vacant value.

use std::alloc::Layout;
use std::ptr::NonNull;

/// An item of a `Table`.
///
/// # Safety
/// The all-zero bit pattern must be a valid value of the type, and a vacant one.
pub(super) unsafe trait Item: Copy {
    fn is_vacant(&self) -> bool;
    /// A uniform 64-bit hash of the item's key; its high bits pick the place.
    fn hash(&self) -> u64;
}

/// A `Hasher` for the side maps of keys that are already uniform hashes (block keys, xxh3
/// outputs): one multiply per field instead of SipHash, whose rounds show in `bench_index`'s
/// mixed apply on keys with many holders (docs/performance.md "Why placement by a folded
/// multiply"). Unseeded: its maps hold only the rare keys with more than four holders or a
/// count above 255, which one hostile engine cannot make in bulk (the tables, which hold every
/// key, are seeded: `scatter`).
#[derive(Default, Clone, Copy)]
pub(super) struct UniformHasher(u64);

impl std::hash::Hasher for UniformHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        // An odd multiplier is a bijection: a uniform field stays uniform in every bit.
        self.0 = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A `HashMap` keyed by uniform hashes (see `UniformHasher`).
pub(super) type UniformMap<K, V> =
    std::collections::HashMap<K, V, std::hash::BuildHasherDefault<UniformHasher>>;

/// Where a probe for `hash` starts in a table of `capacity` places placed with `seed`.
pub(super) fn home(hash: u64, seed: u64, capacity: usize) -> usize {
    ((u128::from(scatter(hash, seed)) * capacity as u128) >> 64) as usize
}

/// `hash` under a secret `seed`, for placement only (shards and table places; never a key):
/// block keys are xxh3 with a public seed, so without it prompts could be mined whose keys
/// share their placement bits and pile into one shard's probe run, under its write lock. With
/// it, which keys meet is a secret of the process (each table and each index draws its own
/// seed, `random_seed`). The mix is a folded multiply (the 128-bit product's halves xored, as
/// foldhash and ahash mix): one multiply, every output bit depending on every input bit, so
/// neither the shard (low bits) nor the home (high bits) can be chosen without the seed. One
/// multiply, not murmur3's finalizer's two: the seed then costs `bench_index apply` a few
/// percent of its instructions (docs/performance.md "Why placement by a folded multiply").
pub(super) fn scatter(hash: u64, seed: u64) -> u64 {
    const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;
    let product = u128::from(hash ^ seed) * u128::from(MULTIPLIER);
    (product as u64) ^ ((product >> 64) as u64)
}

/// A seed from the OS's randomness (std's `RandomState`: random keys per process, a new pair
/// for each call), different for every table and index.
pub(super) fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::hash::RandomState::new().hash_one(0u64)
}

/// The fullest a table may get, `LOAD_NUMERATOR / LOAD_DENOMINATOR`: every probe must end at a
/// vacant place, and long runs cost readers cache lines. 9/10 rather than 7/8: less memory per
/// pair, for somewhat longer probes near the top of the range (docs/performance.md "Why tables
/// grow by half and run to 9/10 full").
const LOAD_NUMERATOR: usize = 9;
const LOAD_DENOMINATOR: usize = 10;
const MIN_CAPACITY: usize = 16;

/// Transparent huge pages can be turned off for measurements: `KV_INDEXER_HUGE_PAGES=0`.
fn huge_pages() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("KV_INDEXER_HUGE_PAGES").map_or(true, |v| v != "0"))
}

pub(super) struct Table<T: Item> {
    places: Places<T>,
    len: usize,
    /// The table's placement seed (`scatter`), fixed for its life.
    seed: u64,
}

impl<T: Item> Default for Table<T> {
    fn default() -> Self {
        Table {
            places: Places::zeroed(0),
            len: 0,
            seed: random_seed(),
        }
    }
}

impl<T: Item> Table<T> {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn capacity(&self) -> usize {
        self.places.len
    }

    /// Address of the first place, for `prefetch`.
    pub(super) fn address(&self) -> usize {
        self.places.ptr.as_ptr() as usize
    }

    /// The placement seed, for `prefetch`.
    pub(super) fn seed(&self) -> u64 {
        self.seed
    }

    /// Starts loading the cache line where `hash`'s probe starts.
    pub(super) fn prefetch(&self, hash: u64) {
        prefetch::<T>(self.address(), self.capacity(), self.seed, hash);
    }

    pub(super) fn get(&self, place: usize) -> &T {
        &self.places.as_slice()[place]
    }

    pub(super) fn get_mut(&mut self, place: usize) -> &mut T {
        &mut self.places.as_mut_slice()[place]
    }

    /// The place of the item with `hash` that `is_it` accepts.
    #[inline]
    pub(super) fn find(&self, hash: u64, is_it: impl Fn(&T) -> bool) -> Option<usize> {
        self.lookup(hash, is_it).ok()
    }

    /// The place of the item with `hash` that `is_it` accepts, or else the vacant place where
    /// such an item would go (for `insert_at`): one walk of the run for both.
    #[inline]
    pub(super) fn lookup(&self, hash: u64, is_it: impl Fn(&T) -> bool) -> Result<usize, Vacant> {
        let places = self.places.as_slice();
        let capacity = places.len();
        if capacity == 0 {
            return Err(Vacant(0));
        }
        let mut place = home(hash, self.seed, capacity);
        loop {
            let item = &places[place];
            if item.is_vacant() {
                return Err(Vacant(place));
            }
            if is_it(item) {
                return Ok(place);
            }
            place = if place + 1 == capacity { 0 } else { place + 1 };
        }
    }

    /// Puts an item (not vacant, whose key is not in the table yet) in, growing first if the
    /// table is full; returns its place.
    pub(super) fn insert(&mut self, item: T) -> usize {
        debug_assert!(!item.is_vacant());
        if self.is_full() {
            self.grow();
        }
        self.len += 1;
        Self::place(self.places.as_mut_slice(), self.seed, item)
    }

    /// `insert` at the place a `lookup` for the item's key found vacant, the table unchanged
    /// since.
    #[inline]
    pub(super) fn insert_at(&mut self, vacant: Vacant, item: T) -> usize {
        if self.is_full() {
            return self.insert(item);
        }
        debug_assert!(!item.is_vacant() && self.get(vacant.0).is_vacant());
        self.len += 1;
        *self.get_mut(vacant.0) = item;
        vacant.0
    }

    fn is_full(&self) -> bool {
        (self.len + 1) * LOAD_DENOMINATOR > self.capacity() * LOAD_NUMERATOR
    }

    fn place(places: &mut [T], seed: u64, item: T) -> usize {
        let capacity = places.len();
        let mut place = home(item.hash(), seed, capacity);
        while !places[place].is_vacant() {
            place = if place + 1 == capacity { 0 } else { place + 1 };
        }
        places[place] = item;
        place
    }

    /// Grows by half: the table stays 60–90 % full. Growing by a quarter (70–88 %) would hold a
    /// pair in a few bytes less but cost much of the apply rate in moves and page faults
    /// (docs/performance.md "Why tables grow by half and run to 9/10 full").
    fn grow(&mut self) {
        let capacity = (self.capacity() + self.capacity() / 2).max(MIN_CAPACITY);
        let mut places = Places::zeroed(capacity);
        for item in self.places.as_slice() {
            if !item.is_vacant() {
                Self::place(places.as_mut_slice(), self.seed, *item);
            }
        }
        self.places = places;
    }

    /// Empties `hole` and shifts later items of the run back, so that every probe still reaches
    /// its item before a vacant place.
    #[inline]
    pub(super) fn remove_at(&mut self, mut hole: usize) {
        let places = self.places.as_mut_slice();
        let capacity = places.len();
        places[hole] = zeroed();
        self.len -= 1;
        let mut next = hole;
        loop {
            next = if next + 1 == capacity { 0 } else { next + 1 };
            if places[next].is_vacant() {
                return;
            }
            let start = home(places[next].hash(), self.seed, capacity);
            // The item may move back to the hole unless its probe starts after the hole.
            let from_start = distance(start, next, capacity);
            let from_hole = distance(hole, next, capacity);
            if from_start >= from_hole {
                places.swap(hole, next);
                hole = next;
            }
        }
    }

    /// Every item, in place order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &T> {
        self.places
            .as_slice()
            .iter()
            .filter(|item| !item.is_vacant())
    }
}

/// Places from `from` forward to `to`, wrapping at `capacity` (both below it); no division, as
/// this runs for every item a removal looks at.
fn distance(from: usize, to: usize, capacity: usize) -> usize {
    if to >= from {
        to - from
    } else {
        to + capacity - from
    }
}

/// A vacant place, as found by `Table::lookup`.
#[derive(Clone, Copy)]
pub(super) struct Vacant(usize);

fn zeroed<T: Item>() -> T {
    // SAFETY: `Item` promises that all-zero bytes are a valid (vacant) value.
    unsafe { std::mem::zeroed() }
}

/// Tables at least this big are mapped from the OS, aligned to huge pages.
pub(super) const HUGE_PAGE: usize = 2 << 20;

const CACHE_LINE: usize = 64;

/// Starts loading the cache line of the item at `place` of the table at `address` (as published
/// by `Table::address`) with `capacity` places and seed `seed`, for the item of `hash`. A stale address only
/// makes the hint useless: a prefetch never faults and is never a read.
#[inline(always)]
pub(super) fn prefetch<T: Item>(address: usize, capacity: usize, seed: u64, hash: u64) {
    const { assert!(CACHE_LINE % std::mem::size_of::<T>() == 0) };
    if capacity == 0 {
        return;
    }
    let line = address.wrapping_add(home(hash, seed, capacity) * std::mem::size_of::<T>());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint to the cache: it never faults and does not access memory
        // as far as the program is concerned, whatever the address.
        #[allow(unused_unsafe)]
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(line as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = line;
}

/// `len` zero-initialised places: from the allocator when small, from `mmap` when big.
struct Places<T> {
    ptr: NonNull<T>,
    len: usize,
    /// Bytes mapped at `ptr` (whole pages), or 0 when allocated.
    mapped: usize,
}

// SAFETY: `Places` owns its memory like a `Box<[T]>`.
unsafe impl<T: Send> Send for Places<T> {}
// SAFETY: shared access only reads, as for a `Box<[T]>`.
unsafe impl<T: Sync> Sync for Places<T> {}

impl<T: Item> Places<T> {
    fn zeroed(len: usize) -> Self {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("table size overflows");
        if bytes == 0 {
            return Places {
                ptr: NonNull::dangling(),
                len,
                mapped: 0,
            };
        }
        if bytes >= HUGE_PAGE {
            // Whole 4 KiB pages: the part past the last whole huge page gets small pages, not a
            // huge page mostly unused.
            let mapped = bytes.next_multiple_of(4096);
            return Places {
                ptr: map_huge(mapped).cast(),
                len,
                mapped,
            };
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr.cast()) else {
            std::alloc::handle_alloc_error(layout)
        };
        Places {
            ptr,
            len,
            mapped: 0,
        }
    }

    fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` points at `len` initialised places (zeroed, then written as `T`s),
        // owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T> Places<T> {
    /// Cache-line aligned, like a mapping: an item whose size divides the line never straddles
    /// two lines, so one prefetch covers it.
    fn layout(len: usize) -> Layout {
        Layout::array::<T>(len)
            .and_then(|layout| layout.align_to(CACHE_LINE))
            .expect("table size overflows")
    }
}

impl<T> Drop for Places<T> {
    fn drop(&mut self) {
        let bytes = self.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return;
        }
        if self.mapped > 0 {
            // SAFETY: `ptr` and `mapped` are exactly what `map_huge` mapped, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
        } else {
            // SAFETY: allocated in `zeroed` with this same layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr().cast(), Self::layout(self.len)) };
        }
    }
}

/// Maps `bytes` (whole pages) of zeroed memory aligned to `HUGE_PAGE`, marked for transparent
/// huge pages.
pub(super) fn map_huge(bytes: usize) -> NonNull<u8> {
    let padded = bytes + HUGE_PAGE;
    // SAFETY: an anonymous private mapping at an address of the kernel's choice touches no
    // existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            padded,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        std::alloc::handle_alloc_error(
            Layout::from_size_align(bytes, HUGE_PAGE).unwrap_or(Layout::new::<u8>()),
        );
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE_PAGE);
    let tail = start + padded - (aligned + bytes);
    // SAFETY: the head and tail trimmed here lie inside the mapping just made and outside the
    // aligned range kept; madvise only advises.
    unsafe {
        if aligned > start {
            libc::munmap(raw, aligned - start);
        }
        if tail > 0 {
            libc::munmap((aligned + bytes) as *mut libc::c_void, tail);
        }
        if huge_pages() {
            libc::madvise(aligned as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE);
        }
    }
    // `aligned` lies inside a successful mapping, so it is not null.
    NonNull::new(aligned as *mut u8).unwrap_or(NonNull::dangling())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Key(u64);

    // SAFETY: zero is the vacant key.
    unsafe impl Item for Key {
        fn is_vacant(&self) -> bool {
            self.0 == 0
        }
        fn hash(&self) -> u64 {
            self.0
        }
    }

    /// Adds and removes keys crowded into few places (so probes wrap around the table's end and
    /// removals shift long runs back), up to a mapped size, and checks every key against a set.
    #[test]
    fn the_table_finds_exactly_the_keys_it_holds_through_growth_and_removals() {
        let mut rng = SmallRng::seed_from_u64(7);
        let mut table = Table::<Key>::default();
        let mut model = HashSet::new();
        let keys: Vec<u64> = (1..400u64)
            .map(|i| [0u64, 1, u64::MAX >> 1, u64::MAX][(i % 4) as usize] & !0xFFFF | i)
            .collect();
        for step in 0..20_000 {
            let key = keys[rng.random_range(0..keys.len())];
            let found = table.find(key, |k| k.0 == key);
            assert_eq!(found.is_some(), model.contains(&key));
            match found {
                Some(place) if rng.random_bool(0.45) => {
                    table.remove_at(place);
                    model.remove(&key);
                }
                None => {
                    let place = table.insert(Key(key));
                    assert_eq!(*table.get(place), Key(key));
                    model.insert(key);
                }
                Some(_) => {}
            }
            if step % 97 == 0 {
                for &key in &keys {
                    assert_eq!(
                        table.find(key, |k| k.0 == key).is_some(),
                        model.contains(&key)
                    );
                }
                assert_eq!(table.len(), model.len());
                assert_eq!(table.iter().count(), model.len());
            }
        }
        // Past the huge-page size the table is mapped; it must read and write the same.
        let mut big = Table::<Key>::default();
        let count = 2 * HUGE_PAGE / 8;
        for i in 1..=count as u64 {
            big.insert(Key(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
        assert!(big.places.mapped > 0);
        assert_eq!(big.places.ptr.as_ptr() as usize % HUGE_PAGE, 0);
        for i in 1..=count as u64 {
            let key = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            assert!(big.find(key, |k| k.0 == key).is_some());
        }
    }

    /// Keys that share their high bits (one home in an unseeded table) get many homes, and two
    /// tables give the same keys different homes.
    #[test]
    fn homes_depend_on_each_tables_secret_seed() {
        let (one, two) = (Table::<Key>::default(), Table::<Key>::default());
        let capacity = 1 << 16;
        let homes = |table: &Table<Key>| -> Vec<usize> {
            (1..=1_000u64)
                .map(|low| home((0xABCD << 48) | low, table.seed(), capacity))
                .collect()
        };
        let (first, second) = (homes(&one), homes(&two));
        let distinct: HashSet<_> = first.iter().collect();
        assert!(
            distinct.len() > 950,
            "{} homes for 1,000 keys",
            distinct.len()
        );
        let moved = first.iter().zip(&second).filter(|(a, b)| a != b).count();
        assert!(moved > 950, "{moved}");
    }
}
