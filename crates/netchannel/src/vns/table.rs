//! Dense stream ids. An id is `generation << 24 | index`: the index addresses a slot directly,
//! and the 8-bit generation tells a late frame for a closed stream (stale: ignored) from a frame
//! for the stream that reuses its slot.

use std::sync::{Arc, RwLock};

use super::Stream;

const INDEX_BITS: u32 = 24;
pub const MAX_STREAMS: u32 = 1 << INDEX_BITS;

pub(crate) enum Lookup {
    Live(Arc<Stream>),
    /// The slot exists but holds another generation or nothing: a frame for a closed stream.
    Stale,
    /// No stream ever had this index: a peer that invents ids.
    Unknown,
}

struct Slot {
    generation: u8,
    stream: Option<Arc<Stream>>,
}

pub(crate) struct StreamTable {
    inner: RwLock<Inner>,
    limit: u32,
}

struct Inner {
    slots: Vec<Slot>,
    free: Vec<u32>,
    live: usize,
}

fn split(id: u32) -> (usize, u8) {
    ((id & (MAX_STREAMS - 1)) as usize, (id >> INDEX_BITS) as u8)
}

impl StreamTable {
    pub fn new(limit: u32) -> Self {
        StreamTable {
            inner: RwLock::new(Inner { slots: Vec::new(), free: Vec::new(), live: 0 }),
            limit: limit.min(MAX_STREAMS),
        }
    }

    /// Allocates an id and stores the stream `make` builds for it; `None` at the limit.
    pub fn insert(&self, make: impl FnOnce(u32) -> Arc<Stream>) -> Option<Arc<Stream>> {
        let mut t = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let index = match t.free.pop() {
            Some(i) => i,
            None if (t.slots.len() as u32) < self.limit => {
                t.slots.push(Slot { generation: 0, stream: None });
                (t.slots.len() - 1) as u32
            }
            None => return None,
        };
        let slot = &mut t.slots[index as usize];
        let id = ((slot.generation as u32) << INDEX_BITS) | index;
        let stream = make(id);
        slot.stream = Some(stream.clone());
        t.live += 1;
        Some(stream)
    }

    pub fn lookup(&self, id: u32) -> Lookup {
        let (index, generation) = split(id);
        let t = self.inner.read().unwrap_or_else(|e| e.into_inner());
        match t.slots.get(index) {
            None => Lookup::Unknown,
            Some(Slot { generation: g, stream: Some(s) }) if *g == generation => {
                Lookup::Live(s.clone())
            }
            Some(_) => Lookup::Stale,
        }
    }

    /// Frees the slot of `id` if it still holds that stream.
    pub fn remove(&self, id: u32) {
        let (index, generation) = split(id);
        let mut t = self.inner.write().unwrap_or_else(|e| e.into_inner());
        let Some(slot) = t.slots.get_mut(index) else {
            return;
        };
        if slot.generation != generation || slot.stream.is_none() {
            return;
        }
        slot.stream = None;
        slot.generation = slot.generation.wrapping_add(1);
        t.free.push(index as u32);
        t.live -= 1;
    }

    pub fn live(&self) -> usize {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).live
    }

    /// The live streams that satisfy `pred` (used on rare events: channel loss, shutdown).
    pub fn collect(&self, mut pred: impl FnMut(&Stream) -> bool) -> Vec<Arc<Stream>> {
        let t = self.inner.read().unwrap_or_else(|e| e.into_inner());
        t.slots.iter().filter_map(|s| s.stream.as_ref()).filter(|s| pred(s)).cloned().collect()
    }
}
