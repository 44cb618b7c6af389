//! Dense stream ids: `id = generation << 24 | index`. The index addresses a slot directly (no
//! hash per frame); the 40-bit generation changes every time a slot is reused, so a late frame
//! for a closed stream can never reach the stream that took its slot (a slot would have to be
//! reused 2^40 times while the frame is in flight). Generation 0 is never issued, so id 0 is
//! never a stream.

pub const INDEX_BITS: u32 = 24;
/// Streams per session.
pub const MAX_STREAMS: u32 = 1 << INDEX_BITS;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// A slot whose generation reached this is retired instead of reused.
const LAST_GENERATION: u64 = (1 << (64 - INDEX_BITS)) - 1;

use super::ids::StreamId;

/// The slot an id (ours or the peer's) names.
pub fn index_of(id: u64) -> usize {
    (id & INDEX_MASK) as usize
}

/// What a peer-supplied id refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    Live,
    /// The slot exists but holds another generation or nothing: a frame for a closed stream.
    Stale,
    /// No stream ever had this index: a peer that invents ids.
    Unknown,
}

struct Slot<T> {
    generation: u64,
    value: Option<Box<T>>,
}

pub struct Table<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
    limit: u32,
}

impl<T> Table<T> {
    pub fn new(limit: u32) -> Self {
        Table { slots: Vec::new(), free: Vec::new(), live: 0, limit: limit.min(MAX_STREAMS) }
    }

    /// Allocates an id and stores what `make` builds for it; `None` at the limit.
    pub fn insert_with(&mut self, make: impl FnOnce(StreamId) -> T) -> Option<StreamId> {
        if self.live >= self.limit as usize {
            return None;
        }
        let index = match self.free.pop() {
            Some(i) => i as usize,
            None if self.slots.len() < self.limit as usize => {
                self.slots.push(Slot { generation: 1, value: None });
                self.slots.len() - 1
            }
            None => return None,
        };
        let slot = &mut self.slots[index];
        let id = StreamId((slot.generation << INDEX_BITS) | index as u64);
        slot.value = Some(Box::new(make(id)));
        self.live += 1;
        Some(id)
    }

    fn slot(&self, id: StreamId) -> Option<&Slot<T>> {
        self.slots.get(id.index()).filter(|s| s.generation == id.0 >> INDEX_BITS)
    }

    pub fn get(&self, id: StreamId) -> Option<&T> {
        self.slot(id)?.value.as_deref()
    }

    pub fn get_mut(&mut self, id: StreamId) -> Option<&mut T> {
        let slot = self.slots.get_mut(id.index())?;
        if slot.generation != id.0 >> INDEX_BITS {
            return None;
        }
        slot.value.as_deref_mut()
    }

    /// What a peer-supplied id refers to (`Live`: it is `StreamId(id)`).
    pub fn lookup(&self, id: u64) -> Lookup {
        match self.slots.get(index_of(id)) {
            None => Lookup::Unknown,
            Some(s) if s.generation == id >> INDEX_BITS && s.value.is_some() => Lookup::Live,
            Some(_) if id >> INDEX_BITS == 0 => Lookup::Unknown,
            Some(_) => Lookup::Stale,
        }
    }

    /// Frees the slot of `id` if it holds that stream.
    pub fn remove(&mut self, id: StreamId) -> Option<Box<T>> {
        let index = id.index();
        let slot = self.slots.get_mut(index)?;
        if slot.generation != id.0 >> INDEX_BITS {
            return None;
        }
        let value = slot.value.take()?;
        self.live -= 1;
        if slot.generation < LAST_GENERATION {
            slot.generation += 1;
            self.free.push(index as u32);
        }
        Some(value)
    }

    pub fn live(&self) -> usize {
        self.live
    }

    pub fn iter(&self) -> impl Iterator<Item = (StreamId, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            s.value.as_deref().map(|v| (StreamId((s.generation << INDEX_BITS) | i as u64), v))
        })
    }

    pub fn ids(&self) -> Vec<StreamId> {
        self.iter().map(|(id, _)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_dense_and_never_alias() {
        let mut t = Table::new(4);
        let a = t.insert_with(|_| 'a').unwrap();
        let b = t.insert_with(|_| 'b').unwrap();
        assert_eq!((a.index(), b.index()), (0, 1));
        assert_ne!(a.get(), 0);
        assert_eq!(t.remove(a), Some(Box::new('a')));
        assert_eq!(t.lookup(a.get()), Lookup::Stale);
        let c = t.insert_with(|_| 'c').unwrap();
        assert_eq!(c.index(), 0, "slot reused");
        assert_ne!(c, a, "with another generation");
        assert_eq!(t.get(a), None);
        assert_eq!(t.get(c), Some(&'c'));
        assert_eq!(t.lookup(7), Lookup::Unknown);
        assert_eq!(t.lookup(1), Lookup::Unknown, "generation 0 is never issued");
        t.insert_with(|_| 'd').unwrap();
        t.insert_with(|_| 'e').unwrap();
        assert_eq!(t.insert_with(|_| 'f'), None, "limit");
        assert_eq!(t.live(), 4);
    }
}
