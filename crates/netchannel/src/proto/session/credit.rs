//! Receive credit: what the peer may send each stream, within one budget for the whole session.
//!
//! Each stream wants `window` bytes beyond what its application consumed. Every stream always
//! gets `min_window` of it (as every TCP socket has its own receive buffer: a stream the
//! application waits on can always make progress, whatever other streams hold); what it wants
//! beyond comes out of the session's receive budget (`CoreConfig::rx_budget`), as far as there
//! is room. Received bytes are therefore bounded by the budget plus `min_window` per stream (the
//! streams the application opened or accepted), reading a channel never has to stop (so
//! acknowledgements and credits keep flowing), and a stream that got less than it wanted waits,
//! in order, for room that reads free. As TCP, a grant is never taken back: a budget lowered
//! below what is granted stops growth until reads bring the total down.
//!
//! What a stream wants is its share of the budget among the streams that compete for it (those
//! holding credit beyond their floor, or waiting for room), at most its own `window`. Granted
//! in order of asking instead, whole 4 MiB windows went to the first eight streams of a 32 MiB
//! budget and left every other busy stream at its floor for good, waiting for a CREDIT halfway
//! through each 64 KiB. A grant is still never taken back, so the first streams keep what they
//! were granted until it is read, and then are granted their share.

use super::*;

/// Room that makes it worth granting to the next starved stream.
const STARVED_QUANTUM: u64 = 64 * 1024;

/// `Session::grant_amount`'s answer.
struct GrantAmount {
    give: u64,
    want: u64,
    floor: u64,
    /// The stream's `fair_window`.
    fair: u64,
}

impl<U: Default> Session<U> {
    /// Room left in the receive budget.
    pub(super) fn rx_room(&self) -> u64 {
        self.cfg.rx_budget.saturating_sub(self.rx_granted)
    }

    /// Sets the receive budget (the engine shares its own among its sessions). Lowering it
    /// takes nothing back; raising it lets starved streams grow.
    pub fn set_rx_budget(&mut self, budget: u64) {
        self.cfg.rx_budget = budget;
        self.feed_starved();
    }

    /// Bytes granted and not yet read, every stream (at most the budget, unless it was
    /// lowered since).
    pub fn rx_granted(&self) -> u64 {
        self.rx_granted
    }

    /// Recomputes what stream `id` holds of the budget: the bytes below its grant (or its
    /// final offset) that its application has not consumed; nothing once it was reset.
    pub(super) fn recharge(&mut self, id: StreamId) {
        let Some(s) = self.streams.get_mut(id) else { return };
        let charge = if s.reset.is_some() {
            // Bytes kept for reading after the peer's reset still take room in the budget.
            s.rx.ready_data()
        } else {
            let limit = s.fin().map_or(s.granted, |f| f.min(s.granted));
            limit.saturating_sub(s.rx.consumed())
        };
        self.rx_granted = self.rx_granted - s.rx_charge + charge;
        s.rx_charge = charge;
        self.update_competing(id);
    }

    /// Flags stream `id` as competing for the budget while it holds credit beyond its floor
    /// or waits for room (`F_STARVED`), and keeps `rx_competing` in step.
    fn update_competing(&mut self, id: StreamId) {
        let Some(s) = self.streams.get(id) else { return };
        let competing = s.rx_charge > self.floor_window(s) || s.flags & F_STARVED != 0;
        if competing != (s.flags & F_COMPETING != 0) {
            self.streams.get_mut(id).expect("checked").flags ^= F_COMPETING;
            if competing {
                self.rx_competing += 1;
            } else {
                self.rx_competing -= 1;
            }
        }
    }

    /// The window stream `s` is granted whatever the budget: `min_window`, or its own window
    /// if smaller.
    pub(super) fn floor_window(&self, s: &Stream<U>) -> u64 {
        s.window.min(self.cfg.min_window) as u64
    }

    /// The window stream `s` wants (see the module's note): its share of the budget among the
    /// competing streams (itself included), at least its floor and at most its own `window`.
    fn fair_window(&self, s: &Stream<U>) -> u64 {
        let competing = self.rx_competing + usize::from(s.flags & F_COMPETING == 0);
        (self.cfg.rx_budget / competing as u64).max(self.floor_window(s)).min(s.window as u64)
    }

    /// Credit stream `s` still wants: up to `consumed + fair_window` (none once it ended).
    fn credit_wanted(&self, s: &Stream<U>) -> u64 {
        if s.credit_wanted() == 0 {
            return 0;
        }
        (s.rx.consumed() + self.fair_window(s)).saturating_sub(s.granted)
    }

    /// What stream `s` may be granted now: `want` grows the grant to `consumed + fair` (its
    /// `fair_window`), `floor` is the part up to `consumed + floor_window` (always given), and
    /// `give` adds to it what the budget has room for.
    fn grant_amount(&self, s: &Stream<U>) -> GrantAmount {
        let consumed = s.rx.consumed();
        let fair = self.fair_window(s);
        let want = (consumed + fair).saturating_sub(s.granted);
        let floor = (consumed + self.floor_window(s)).saturating_sub(s.granted);
        GrantAmount { give: want.min(floor + self.rx_room()), want, floor, fair }
    }

    /// Grows stream `id`'s grant toward `consumed + fair_window` as far as the budget allows
    /// (and to `min_window` at least) and returns the window to advertise (`granted -
    /// consumed`). A stream that got less than it wanted queues for room.
    pub(super) fn grant(&mut self, id: StreamId) -> u32 {
        let Some(s) = self.streams.get(id) else { return 0 };
        let GrantAmount { give, want, .. } = self.grant_amount(s);
        let s = self.streams.get_mut(id).expect("checked");
        let consumed = s.rx.consumed();
        s.granted += give;
        let window = (s.granted - consumed) as u32;
        if give < want && s.flags & F_STARVED == 0 {
            self.queue_starved(id);
        }
        self.recharge(id);
        window
    }

    /// Whether a CREDIT is worth sending for `id`: its grant can grow by a quarter window (few
    /// control frames per window of data), or its guaranteed `min_window` is half used up. One
    /// that wants a quarter window and finds no room queues for it.
    pub(super) fn credit_due(&mut self, id: StreamId) -> bool {
        let Some(s) = self.streams.get(id) else { return false };
        let GrantAmount { give, want, floor, fair } = self.grant_amount(s);
        if s.credit_wanted() == 0 || want == 0 {
            return false;
        }
        let half_min = (self.floor_window(s) / 2).max(1);
        // Never more often than per half floor: a stream whose share is its floor is credited
        // as one without a share was.
        let quarter = (fair / 4).max(half_min);
        let s = self.streams.get_mut(id).expect("checked");
        if want >= quarter && give < quarter && s.flags & F_STARVED == 0 {
            self.queue_starved(id);
        }
        give >= quarter || floor >= half_min
    }

    /// Queues `id` for receive room. Streams that went while queued leave their ids behind
    /// (taken off only as room frees): once those outnumber the live streams, they are swept,
    /// so a peer that opens and resets streams while the budget is held cannot grow the queue.
    fn queue_starved(&mut self, id: StreamId) {
        let Some(s) = self.streams.get_mut(id) else { return };
        s.flags |= F_STARVED;
        self.update_competing(id);
        self.starved.push_back(id);
        if self.starved.len() > 2 * self.streams.live() + 64 {
            let streams = &self.streams;
            self.starved.retain(|&id| streams.get(id).is_some_and(|s| s.flags & F_STARVED != 0));
        }
    }

    /// Reads freed room: streams that waited for it owe a CREDIT, in order, as far as the
    /// room goes.
    pub(super) fn feed_starved(&mut self) {
        let mut room = self.rx_room();
        while room >= STARVED_QUANTUM {
            let Some(id) = self.starved.pop_front() else { return };
            let Some(s) = self.streams.get(id) else { continue };
            let want = self.credit_wanted(s);
            let s = self.streams.get_mut(id).expect("checked");
            s.flags &= !F_STARVED;
            self.update_competing(id);
            if want == 0 {
                continue;
            }
            room -= want.min(room);
            self.owe(id, OWE_CREDIT);
        }
    }
}
