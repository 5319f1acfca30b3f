//! Prefix reuse: a finished sequence's state is kept, with the tokens it holds, so a
//! later prompt that continues it (the next turn of a conversation: the earlier turns,
//! the reply, the new message) starts from it instead of computing those positions
//! again. Bounded by the bytes of the caches kept; the least recently kept go first.
//!
//! A prompt that continues *all* of a held sequence's tokens takes its state whole. One
//! that shares only a prefix with it (the same system prompt and a different question)
//! gets a copy of the state's first positions when every layer can give them back
//! (KV caches can; a sliding-window ring that has gone past them, or a recurrent
//! state, cannot), and the held state stays for others.

use sluice_engine::{Backend, SeqState};

struct Held<B: Backend> {
    tokens: Vec<u32>,
    state: SeqState<B>,
    bytes: usize,
}

pub struct PrefixCache<B: Backend> {
    /// Oldest first.
    held: Vec<Held<B>>,
    budget: usize,
    bytes: usize,
}

impl<B: Backend> PrefixCache<B> {
    pub fn new(budget: usize) -> Self {
        PrefixCache { held: Vec::new(), budget, bytes: 0 }
    }

    /// Keeps a finished sequence's state (`tokens` are what it holds), dropping the
    /// oldest kept while over the budget.
    pub fn put(&mut self, tokens: Vec<u32>, state: SeqState<B>, bytes: usize) {
        if tokens.is_empty() || bytes > self.budget || tokens.len() != state.len() {
            return;
        }
        self.bytes += bytes;
        self.held.push(Held { tokens, state, bytes });
        while self.bytes > self.budget {
            let old = self.held.remove(0);
            self.bytes -= old.bytes;
        }
    }

    /// A state to start `prompt` from, with the tokens it holds: the held state whose
    /// tokens `prompt` continues, taken out of the cache, or a copy of the first
    /// positions of the one that shares the longest prefix with it (at least
    /// [`MIN_SHARED`] tokens). At least the prompt's last token is left to compute.
    pub fn take(&mut self, be: &B, prompt: &[u32]) -> Option<(SeqState<B>, Vec<u32>)> {
        let room = prompt.len().checked_sub(1)?;
        // The most recently kept wins a tie.
        let (i, shared) = self
            .held
            .iter()
            .enumerate()
            .map(|(i, h)| (i, common_prefix(&h.tokens, prompt).min(room)))
            .max_by_key(|&(i, n)| (n, i))?;
        if shared == 0 {
            return None;
        }
        if shared == self.held[i].tokens.len() {
            let h = self.held.remove(i);
            self.bytes -= h.bytes;
            return Some((h.state, h.tokens));
        }
        if shared < MIN_SHARED {
            return None;
        }
        // A copy that fails (out of device memory) is a miss, not an error.
        let state = self.held[i].state.prefix(be, shared).ok().flatten()?;
        let h = self.held.remove(i);
        self.held.push(h);
        Some((state, prompt[..shared].to_vec()))
    }
}

/// Fewest shared tokens worth copying a held state's first positions for.
pub const MIN_SHARED: usize = 16;

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
